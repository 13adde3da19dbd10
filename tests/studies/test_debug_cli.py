"""``fmtkit debug RUNDIR``: the summary agrees with the logs, computed here by plain Python.

A synthetic run is logged with ``StatsLogger`` over several steps, with the worst entries of
each metric placed by hand (module, GEMM, tensor and step); the summary must name exactly
those, with the values the TensorBoard reader and the JSON lines hold.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from fmtkit.debug.log import StatsLogger
from studies.app.cli import main

STEPS = (0, 10, 20, 30)
MODULES = ("Block_0/Attn_0/Dense_0", "Block_0/MlpBlock_0/Dense_1", "")
TENSORS = ("activation", "weight", "output_grad")

# Hand-placed worst entries: (metric, module, gemm, tensor, step, value).
PLACED = [
    ("underflow_share", "Block_0/MlpBlock_0/Dense_1", "dot_general_1", "output_grad", 20, 0.75),
    ("underflow_share", "", "dot_general_0", "weight", 10, 0.5),
    ("saturation_share", "Block_0/Attn_0/Dense_0", "dot_general_0", "activation", 30, 0.125),
    ("sqnr_db", "Block_0/MlpBlock_0/Dense_1", "dot_general_0", "activation", 10, -3.0),
    ("sqnr_db", "", "dot_general_1", "output_grad", 0, 2.5),
    ("dynamic_range", "Block_0/Attn_0/Dense_0", "dot_general_1", "weight", 30, 40.0),
]


def run_stats(step: int) -> dict:
    """Every module, GEMM and tensor with ordinary values, the placed ones at their step."""
    rng = np.random.default_rng(step)
    stats = {}
    for module in MODULES:
        for gemm in ("dot_general_0", "dot_general_1"):
            for tensor in TENSORS:
                stats.setdefault(module, {}).setdefault(gemm, {})[tensor] = {
                    "underflow_share": float(rng.uniform(0.0, 0.1)),
                    "saturation_share": float(rng.uniform(0.0, 0.01)),
                    "sqnr_db": float(rng.uniform(20.0, 40.0)),
                    "dynamic_range": float(rng.uniform(5.0, 20.0)),
                    "amax": float(rng.uniform(1.0, 2.0)),
                }
    for metric, module, gemm, tensor, s, value in PLACED:
        if s == step:
            stats[module][gemm][tensor][metric] = value
    # An exact quantization (inf SQNR) is the best, never the worst.
    stats[""]["dot_general_0"]["activation"]["sqnr_db"] = float("inf")
    return stats


@pytest.fixture
def rundir(tmp_path):
    with StatsLogger(tmp_path) as log:
        for step in STEPS:
            log.write(step, run_stats(step))
    return tmp_path


def expected(metric: str, top: int) -> list[dict]:
    """The worst entries by plain Python over the synthetic dicts."""
    larger = metric != "sqnr_db"
    worst = {}
    for step in STEPS:
        for module, gemms in run_stats(step).items():
            for gemm, tensors in gemms.items():
                for tensor, entries in tensors.items():
                    v = entries[metric]
                    key = (module, gemm, tensor)
                    if key not in worst or (v > worst[key][0] if larger else v < worst[key][0]):
                        worst[key] = (v, step)
    rows = sorted(worst.items(), key=lambda kv: -kv[1][0] if larger else kv[1][0])[:top]
    return [{"metric": metric, "module": m, "gemm": g, "tensor": t, "value": v, "step": s}
            for (m, g, t), (v, s) in rows]


def summary(capsys, *args) -> dict:
    assert main(["debug", *map(str, args), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_summary_names_the_placed_worst_entries(rundir, capsys):
    got = summary(capsys, rundir, "--top", 2)
    assert list(got) == ["underflow_share", "saturation_share", "sqnr_db", "dynamic_range"]
    for metric, rows in got.items():
        assert rows == expected(metric, 2)
        placed = [p for p in PLACED if p[0] == metric]
        for (_, module, gemm, tensor, step, value), row in zip(placed, rows):
            assert (row["module"], row["gemm"], row["tensor"], row["step"], row["value"]) == (
                module, gemm, tensor, step, value)


def test_summary_agrees_with_tensorboard_and_jsonl(rundir, capsys):
    got = summary(capsys, rundir, "--top", 5, "--metric", "sqnr_db", "--metric", "amax")
    acc = EventAccumulator(str(rundir), size_guidance={"scalars": 0})
    acc.Reload()
    lines = [json.loads(x) for x in (rundir / "stats.jsonl").read_text().splitlines()]
    for metric, rows in got.items():
        assert rows == expected(metric, 5)
        for row in rows:
            tag = "/".join(p for p in (row["module"], row["gemm"], row["tensor"], metric) if p)
            tb = dict((e.step, e.value) for e in acc.Scalars(tag))
            assert tb[row["step"]] == float(np.float32(row["value"]))
            by_step = {rec["step"]: rec["stats"][tag] for rec in lines}
            assert by_step[row["step"]] == row["value"]
            worst = max(by_step.values()) if metric == "amax" else min(by_step.values())
            assert worst == row["value"]


def test_table_and_plots(rundir, capsys):
    assert main(["debug", str(rundir), "--top", "1", "--plots"]) == 0
    out = capsys.readouterr().out
    assert "4 logged steps (0..30)" in out
    rows = [line.split() for line in out.splitlines() if line.startswith("  ")]
    for _, module, gemm, tensor, step, value in (PLACED[0], PLACED[2], PLACED[3], PLACED[5]):
        assert [module or "(root)", gemm, tensor, f"{value:.4g}", str(step)] in rows
    assert len(rows) == 4 * 2  # a header and one row (--top 1) per metric
    pngs = sorted(p.name for p in (rundir / "plots").glob("*.png"))
    assert pngs == ["Block_0.Attn_0.Dense_0.png", "Block_0.MlpBlock_0.Dense_1.png",
                    "root.png"]
    assert all((rundir / "plots" / n).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for n in pngs)


def test_decisions_are_listed_after_the_tables(rundir, capsys):
    with StatsLogger(rundir, tensorboard=False) as log:
        log.log_decision(30, "Block_0/MlpBlock_0/Dense_1", "dot_general_1", "compute_dtype",
                         "output_grad/underflow_share", 0.75)
    assert main(["debug", str(rundir), "--top", "1"]) == 0
    out = capsys.readouterr().out
    tail = out.split("precision decisions (decisions.jsonl)")[1].splitlines()
    assert tail[2].split() == ["30", "Block_0/MlpBlock_0/Dense_1", "dot_general_1",
                               "compute_dtype", "output_grad/underflow_share", "0.75"]


def test_bad_input_names_the_argument(tmp_path, capsys):
    assert main(["debug", str(tmp_path / "missing")]) == 2
    assert "RUNDIR" in capsys.readouterr().err
    assert main(["debug", str(tmp_path)]) == 2
    assert "stats.jsonl" in capsys.readouterr().err
    (tmp_path / "stats.jsonl").write_text("")
    assert main(["debug", str(tmp_path)]) == 2
    assert "no logged step" in capsys.readouterr().err
    (tmp_path / "stats.jsonl").write_text('{"step": 1}\n')
    assert main(["debug", str(tmp_path)]) == 2
    assert "line 1" in capsys.readouterr().err
    with StatsLogger(tmp_path / "run", tensorboard=False) as log:
        log.write(0, run_stats(0))
    assert main(["debug", str(tmp_path / "run"), "--metric", "loudness"]) == 2
    err = capsys.readouterr().err
    assert "--metric 'loudness'" in err and "underflow_share" in err
    assert main(["debug", str(tmp_path / "run"), "--metric", "mse"]) == 2
    assert "--metric 'mse' is not in stats.jsonl" in capsys.readouterr().err
    assert main(["debug", str(tmp_path / "run"), "--top", "0"]) == 2
    assert "--top" in capsys.readouterr().err


def test_a_scanned_stack_is_ranked_and_plotted_layer_by_layer(tmp_path, capsys):
    # One stacked GEMM, three layers (the statistics state's f32[3] leaves), layer 1 worst.
    stats = {"layers/Dense_0": {"dot_general_0": {"activation": {
        "underflow_share": np.array([0.01, 0.5, 0.02], np.float32)}}}}
    with StatsLogger(tmp_path, layers=stats) as log:
        assert log.write(0, stats) == 3
    got = summary(capsys, tmp_path, "--metric", "underflow_share", "--top", "2")
    assert [(r["module"], r["value"]) for r in got["underflow_share"]] == [
        ("layers/Dense_0[1]", float(np.float32(0.5))),
        ("layers/Dense_0[2]", float(np.float32(0.02)))]
    assert main(["debug", str(tmp_path), "--metric", "underflow_share", "--plots"]) == 0
    assert sorted(p.name for p in (tmp_path / "plots").glob("*.png")) == [
        f"layers.Dense_0_{i}.png" for i in range(3)]
