"""The fp8-matmul benchmark and the prepared GPU check, on a machine without a GPU."""

import ast
import json
import sys
import time
from pathlib import Path

import jax
import pytest

from pallas_kernels import gpu_check
from studies.bench import fp8_matmul as bench_fp8_matmul

no_gpu = pytest.mark.skipif(jax.default_backend() == "gpu", reason="checks the no-GPU path")


@no_gpu
def test_bench_says_no_gpu_and_exits_0(capsys, tmp_path):
    assert bench_fp8_matmul.main(["--out", str(tmp_path)]) == 0
    assert "no GPU present" in capsys.readouterr().out
    assert not (tmp_path / "results.json").exists()


def test_bench_default_shapes_are_the_issues():
    assert bench_fp8_matmul.DEFAULT_SHAPES == (
        (4096, 4096, 4096), (8192, 8192, 8192), (4096, 7168, 2048), (4096, 2112, 7168),
        (4096, 24576, 1536), (4096, 7168, 16384))


@pytest.mark.parametrize("text,match", [("12x12", "not MxNxK"), ("64x64x100", "multiple of 128"),
                                        ("0x128x128", "not MxNxK")])
def test_bench_rejects_bad_shapes(text, match):
    with pytest.raises(ValueError, match=match):
        bench_fp8_matmul.parse_shapes(text)
    with pytest.raises(SystemExit):
        bench_fp8_matmul.main(["--shapes", text])


def test_bench_shape_times_the_baselines():
    """The timing path without the kernel (what a non-Hopper machine runs): every
    implementation gets a time and a TFLOP/s figure consistent with it."""
    r = bench_fp8_matmul.bench_shape(128, 128, 256, repeats=1, with_kernel=False)
    assert set(r["tflops"]) == {"xla_bf16", "reference"}
    for name, t in r["seconds"].items():
        assert t > 0
        assert r["tflops"][name] == pytest.approx(2 * 128 * 128 * 256 / t / 1e12)


@no_gpu
def test_gpu_check_without_gpu_writes_status_and_exits_0(tmp_path, capsys):
    assert gpu_check.main(["--out-dir", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["status"].startswith("no Hopper GPU")
    assert report["env"]["backend"] == jax.default_backend()
    assert "no Hopper GPU" in capsys.readouterr().out


def test_pallas_kernels_never_imports_studies():
    """Layering (issue 13): the kernels package depends on the core, never on studies."""
    root = Path(gpu_check.__file__).parent
    for file in root.glob("*.py"):
        for node in ast.walk(ast.parse(file.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n == "studies" or n.startswith("studies.") for n in names), file


def _sleeper(progress, item="shape-1", delay=0.0):
    """A worker stand-in: writes its progress file after ``delay`` s, then hangs."""
    return [sys.executable, "-c",
            f"import json, time; time.sleep({delay}); open({str(progress)!r}, 'w').write("
            f"json.dumps({{'item': {item!r}, 'started': time.time()}})); time.sleep(120)"]


def test_watcher_kills_a_hung_item(tmp_path):
    progress = tmp_path / "p.json"
    t0 = time.time()
    out = gpu_check.supervise(_sleeper(progress), progress, item_timeout=1.0,
                              deadline_at=t0 + 60, log_file=tmp_path / "log")
    assert out["killed"] == "item ran past its 1 s timeout"
    assert out["item"] == "shape-1" and out["returncode"] != 0
    assert time.time() - t0 < 30  # not the sleeper's 120 s


@pytest.mark.parametrize("case", ["deadline", "startup"])
def test_watcher_kills_at_the_deadline_and_on_a_stuck_start(tmp_path, case):
    progress = tmp_path / "p.json"
    t0 = time.time()
    if case == "deadline":  # the item's own timeout is far away; the global one is not
        out = gpu_check.supervise(_sleeper(progress), progress, item_timeout=600,
                                  deadline_at=t0 + 2, log_file=tmp_path / "log")
        assert out["killed"] == "deadline"
    else:  # never writes progress within the startup timeout
        out = gpu_check.supervise(_sleeper(progress, delay=60), progress, item_timeout=600,
                                  deadline_at=t0 + 60, log_file=tmp_path / "log",
                                  startup_timeout=1.0)
        assert out["killed"] == "no item started within 1 s"
    assert time.time() - t0 < 30


def test_parse_ptxas_groups_lines_by_config():
    log = "\n".join([
        "=== gpu_check smoke: config bm128_bn128_splitm_s4 (bfloat16) ===",
        "ptxas info    : Compiling entry function 'blockwise_fp8_matmul' for 'sm_90a'",
        "ptxas info    : Used 168 registers, used 1 barriers, 32 bytes cmem[0]",
        "ptxas info    : Function properties for blockwise_fp8_matmul",
        "    0 bytes stack frame, 8 bytes spill stores, 8 bytes spill loads",
        "[smoke] matmul-bm128_bn128_splitm_s4-bfloat16-2048x2048x1024: ok (3.1 s)",
        "=== gpu_check smoke: config bm64_bn256_splitn_s4 (float32) ===",
        "unrelated output",
    ])
    groups = gpu_check.parse_ptxas(log)
    assert len(groups) == 1
    g = groups[0]
    assert g["config"] == "bm128_bn128_splitm_s4 (bfloat16)"
    assert g["max_registers"] == 168 and g["max_spill_store_bytes"] == 8
    assert len(g["lines"]) == 4


@pytest.mark.slow
def test_gpu_check_rehearsal_on_cpu(tmp_path):
    """The whole watcher/worker path on CPU (GPU-interpret mode), one bench item: results
    written per item, the summary report assembled, exit status 0."""
    rc = gpu_check.main(["--cpu-rehearsal", "--out-dir", str(tmp_path), "--phases", "bench",
                         "--repeats", "1"])
    assert rc == 0
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["status"] == "passed"
    [(name, item)] = report["phases"]["bench"]["items"].items()
    assert name == "256x256x256" and item["ok"]
    assert set(item["tflops"]) == {"pallas_fp8", "xla_bf16"}
    assert item["timing"]["pallas_fp8"]["method"] == "host_loop"
    assert json.loads((tmp_path / "bench.json").read_text())["items"][name]["ok"]


@no_gpu
@pytest.mark.slow
def test_gpu_check_pytest_phase_parses_verdicts(tmp_path):
    """The last phase on a machine without a GPU: every compiled-mode test is collected and
    skipped; the verdicts are read from the verbose log."""
    r = gpu_check.run_pytest(300, tmp_path / "pytest.log")
    assert r["ok"] and r["failures"] == []
    assert r["counts"]["SKIPPED"] >= 10 and r["counts"]["PASSED"] == 0
