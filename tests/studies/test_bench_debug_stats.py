"""Smoke test of ``fmtkit bench debug-stats`` at toy sizes (the timings are a benchmark, not
a test): the three steps run and land in the JSON with the statistics count."""

import json

import pytest

from studies.bench import debug_stats as bench_debug_stats


@pytest.mark.slow  # compiles three train steps of a transformer
def test_bench_debug_stats_runs_off_and_on(tmp_path, capsys):
    rc = bench_debug_stats.main(["--d-model", "32", "--heads", "2", "--layers", "1",
                                 "--seq", "8", "--batch", "2", "--rounds", "1", "--freq", "2",
                                 "--out", str(tmp_path)])
    assert rc == 0
    res = json.loads((tmp_path / "results.json").read_text())
    assert set(res["mean_step_s"]) == {"off", "on", "on-traced"}
    assert res["statistics_logged"] > 0
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("ratio on/off")


def test_bench_debug_stats_rejects_an_unknown_policy():
    with pytest.raises(SystemExit):
        bench_debug_stats.main(["--policy", "fp7"])
