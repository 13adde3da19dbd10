"""The fmtkit CLI: format table, inspect, bench listing, and errors."""

import json
import os

import pytest

from studies.app.cli import exact_low_precision_flags, main


def test_formats_json(capsys):
    assert main(["formats", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert len(rows) == 14
    assert rows["float8_e4m3fn"]["max"] == 448.0  # OCP FP8 spec: 0x7E
    assert rows["float8_e5m2"]["max"] == 57344.0  # OCP FP8 spec: 0x7B
    assert "e4m3" in rows["float8_e4m3fn"]["aliases"]


def test_formats_table(capsys):
    assert main(["formats"]) == 0
    out = capsys.readouterr().out
    assert "float4_e2m1fn" in out and "65504" in out


def test_inspect(capsys):
    assert main(["inspect", "0.1", "70000", "-f", "fp16", "--json"]) == 0
    recs = json.loads(capsys.readouterr().out)
    assert recs[0]["bits"] == "0 01011 1001100110"
    assert recs[1]["kind"] == "inf (overflow)"


def test_inspect_unknown_format(capsys):
    assert main(["inspect", "1", "-f", "fp9"]) == 2
    assert "Valid names" in capsys.readouterr().err


def test_bench_list(capsys):
    assert main(["bench", "list"]) == 0
    assert "quantize" in capsys.readouterr().out


def test_bench_unknown():
    with pytest.raises(SystemExit, match="valid:"):
        main(["bench", "nope"])


def test_policies_lists_presets(capsys):
    assert main(["policies"]) == 0
    out = capsys.readouterr().out
    for name in ("fp32", "bf16-mixed", "fp16-mixed", "pure-bf16", "fp8-blockwise"):
        assert f"{name}:" in out


def test_python_dash_m_runs_the_cli():
    # The console script `fmtkit` and `python -m studies.app.cli` are the same entry point.
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-m", "studies.app.cli", "inspect", "1", "-f", "e4m3",
                          "--json"], cwd=root, capture_output=True, text=True, timeout=120,
                         check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    (rec,) = json.loads(out.stdout)
    assert rec["bits"] == "0 0111 000"  # 1.0 in e4m3fn: exponent = bias 7, mantissa 0

def test_cli_sets_the_flag(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/x")
    exact_low_precision_flags()
    assert os.environ["XLA_FLAGS"] == "--xla_dump_to=/tmp/x --xla_allow_excess_precision=false"
