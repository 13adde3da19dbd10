"""The prepared GPU check (``tools.gpu_check``) on a machine without a GPU (the fp8-matmul
benchmark's own tests are in ``tests/studies/test_bench_fp8_matmul.py``)."""

import ast
import json
import sys
import tarfile
import time
from pathlib import Path

import jax
import pytest

from tools.gpu_check import compilation, correctness, kernel_tests, watcher
from tools.gpu_check.cli import main

no_gpu = pytest.mark.skipif(jax.default_backend() == "gpu", reason="checks the no-GPU path")


@no_gpu
def test_gpu_check_without_gpu_writes_status_and_exits_0(tmp_path, capsys):
    assert main([str(tmp_path)]) == 0
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["status"].startswith("no Hopper GPU")
    assert report["env"]["backend"] == jax.default_backend()
    assert "no Hopper GPU" in capsys.readouterr().out
    assert sorted(f.name for f in tmp_path.iterdir()) == ["gpu_check.json",
                                                          "gpu_check_logs.tar.gz"]


def test_the_tool_never_imports_the_studies_application():
    """The tool runs the studies' command line as a command; of ``studies`` it imports the
    libraries only (``studies.lib``: the timing loop, the environment capture), never the
    application or a study (``tests/test_layering.py`` checks the whole table; this is the
    check by hand)."""
    root = Path(watcher.__file__).parent
    files = sorted(root.glob("*.py"))
    assert len(files) > 10
    used = set()
    for file in files:
        for node in ast.walk(ast.parse(file.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            studies = [n for n in names if n == "studies" or n.startswith("studies.")]
            assert all(n.startswith("studies.lib.") for n in studies), file
            used |= set(studies)
    assert used == {"studies.lib.timing", "studies.lib.common"}


def _sleeper(progress, item="shape-1", delay=0.0):
    """A worker stand-in: writes its progress file after ``delay`` s, then hangs."""
    return [sys.executable, "-c",
            f"import json, time; time.sleep({delay}); open({str(progress)!r}, 'w').write("
            f"json.dumps({{'item': {item!r}, 'started': time.time()}})); time.sleep(120)"]


def test_watcher_kills_a_hung_item(tmp_path):
    progress = tmp_path / "p.json"
    t0 = time.time()
    out = watcher.supervise(_sleeper(progress), progress, item_timeout=1.0,
                              deadline_at=t0 + 60, log_file=tmp_path / "log")
    assert out["killed"] == "item ran past its 1 s timeout"
    assert out["item"] == "shape-1" and out["returncode"] != 0
    assert time.time() - t0 < 30  # not the sleeper's 120 s


@pytest.mark.parametrize("case", ["deadline", "startup"])
def test_watcher_kills_at_the_deadline_and_on_a_stuck_start(tmp_path, case):
    progress = tmp_path / "p.json"
    t0 = time.time()
    if case == "deadline":  # the item's own timeout is far away; the global one is not
        out = watcher.supervise(_sleeper(progress), progress, item_timeout=600,
                                  deadline_at=t0 + 2, log_file=tmp_path / "log")
        assert out["killed"] == "deadline"
    else:  # never writes progress within the startup timeout
        out = watcher.supervise(_sleeper(progress, delay=60), progress, item_timeout=600,
                                  deadline_at=t0 + 60, log_file=tmp_path / "log",
                                  startup_timeout=1.0)
        assert out["killed"] == "no item started within 1 s"
    assert time.time() - t0 < 30


def test_parse_ptxas_attributes_lines_to_kernels_by_name():
    """ptxas's report is attributed by the entry function's name even when the compile
    of one kernel prints another's (Mosaic GPU may decorate the name), by the item marker
    where no name is given; all lines are kept, the wgmma warning is found."""
    a = "blockwise_fp8_matmul_bm128_bn128_splitm_s6_bfloat16"
    b = "blockwise_fp8_matmul_bm128_bn128_splitm_s6_bfloat16_brows"
    log = "\n".join([
        f"=== gpu_check kernel: {a} ===",
        f"ptxas info    : Compiling entry function 'mosaic_gpu_{b}' for 'sm_90a'",
        f"ptxas info    : Function properties for mosaic_gpu_{b}",
        "    8 bytes stack frame, 24 bytes spill stores, 16 bytes spill loads",
        "ptxas info    : Used 232 registers, used 1 barriers",
        f"ptxas info    : Compiling entry function 'mosaic_gpu_{a}' for 'sm_90a'",
        "ptxas info    : Used 168 registers, used 1 barriers, 32 bytes cmem[0]",
        *[f"ptxas info    : extra line {i}" for i in range(50)],
        "=== gpu_check kernel: end ===",
        "ptxas info    : Used 99 registers (outside any kernel)",
        f"=== gpu_check kernel: {b} ===",
        "ptxas warning : Potential Performance Loss: wgmma.mma_async instructions are "
        "serialized due to insufficient register resources for the wgmma pipeline",
        "unrelated output",
    ])
    got = compilation.parse_ptxas(log, [a, b])
    assert got[a]["registers"] == 168 and got[a]["spill_store_bytes"] is None
    assert len(got[a]["lines"]) == 52  # entry, registers, 50 more: no cut
    assert got[b]["registers"] == 232
    assert (got[b]["spill_store_bytes"], got[b]["spill_load_bytes"]) == (24, 16)
    assert got[b]["stack_frame_bytes"] == 8
    assert len(got[b]["wgmma_serialization_warnings"]) == 1
    assert got[a]["wgmma_serialization_warnings"] == []


def test_parse_sass_counts_instructions_per_kernel():
    """SASS lines (predicated or not) are counted per kernel by the marker before them;
    lines after the end marker belong to no kernel."""
    log = "\n".join([
        f"{compilation.KERNEL_MARK}k1 ===",
        "        /*0000*/                   LDC R1, c[0x0][0x28] ;",
        "        /*0010*/              @!P0 LDG.E R2, desc[UR4][R2.64] ;",
        "        /*0020*/                   HGMMA.64x128x32.F32.E4M3.E4M3 R24, gdesc[UR8] ;",
        "        /*0030*/               @P1 BRA 0x40 ;",
        "        /*0040*/                   UTMALDG.2D [UR8], [UR4] ;",
        f"{compilation.KERNEL_MARK}end ===",
        "        /*0000*/                   LDG.E R2, desc[UR4][R2.64] ;",
        f"{compilation.KERNEL_MARK}k2 ===",
        "        /*0000*/                   STG.E desc[UR4][R2.64], R0 ;",
    ])
    got = compilation.parse_sass(log)
    assert got == {"k1": {"instructions": 5, "LDG": 1, "HGMMA": 1, "BRA": 1, "UTMALDG": 1},
                   "k2": {"instructions": 1, "STG": 1}}


def test_gemm_targets_and_rewriter_lines():
    from tools.gpu_check.per_tensor import gemm_targets
    from tools.gpu_check.report import rewriter_lines

    hlo = ('%a = custom-call(x, y), custom_call_target="__cublas$lt$matmul$f8"\n'
           '%b = custom-call(x, y), custom_call_target="__cublas$lt$matmul"\n'
           '%c = custom-call(x), custom_call_target="mosaic_gpu_v2"\n'
           '%d = custom-call(x, y), custom_call_target="__cublas$lt$matmul$f8"\n'
           '%e = fusion(x, y), kind=kCustom, backend_config={"fusion_backend_config":'
           '{"kind":"__triton_gemm"}}')
    assert gemm_targets(hlo) == {"__cublas$lt$matmul$f8": 2, "__cublas$lt$matmul": 1,
                                 "__triton_gemm": 1}
    log = ("I gemm_rewriter.cc:1] %dot.1 rewritten into FP8 Custom Call.\n"
           "unrelated\n"
           "I gemm_rewriter.cc:2] Possible intended FP8 GEMM operating on %x not rewritten "
           "into FP8 Custom Call.")
    lines = rewriter_lines(log)
    assert len(lines) == 2 and "not rewritten" in lines[0]


def test_float64_errors_finds_the_block_with_a_wrong_scale():
    """The correctness measure on a known error: the reference output with one 128x128
    output block scaled by 1.01 has that block as its worst, with rel_fro 1e-2."""
    import numpy as np

    from pallas_kernels import blockwise_fp8_matmul_reference

    ops = correctness.block_magnitude_operands(384, 256, 256, seed=0)
    out = blockwise_fp8_matmul_reference(ops["xq"], ops["xs"], ops["wq"], ops["ws"],
                                         out_dtype="float32")
    clean = correctness.float64_errors(out, ops)
    assert clean["rel_fro_vs_float64"] < 1e-6
    assert clean["sampled_rows"] == 3 * 43 and clean["sampled_cols"] == 2 * 64
    bad = np.asarray(out).copy()
    bad[128:256, 128:256] *= 1.01
    got = correctness.float64_errors(bad, ops)
    worst = got["worst_blocks"][0]
    assert (worst["row_block"], worst["col_block"]) == (1, 1)
    assert worst["rel_fro"] == pytest.approx(1e-2, rel=1e-3)
    assert got["worst_blocks"][1]["rel_fro"] < 1e-6


@pytest.mark.slow
def test_gpu_check_rehearsal_on_cpu(tmp_path):
    """The whole watcher/worker path on CPU (GPU-interpret mode, tiny shapes), every phase
    but pytest: the summary has every field, GPU-only values are null (not invented), and
    the folder holds the summary, the log tarball and the profile phase's traces only."""
    rc = main(["--cpu-rehearsal", str(tmp_path)])
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert rc == 0, json.dumps(report["phases"], indent=1)[:4000]
    assert report["status"] == "passed"
    assert sorted(f.name for f in tmp_path.iterdir()) == sorted(
        ["gpu_check.json", "gpu_check_logs.tar.gz", *report["profile_traces"]])
    assert len(report["profile_traces"]) == 2  # tests/tools/test_gpu_check_profile.py
    with tarfile.open(tmp_path / "gpu_check_logs.tar.gz") as tar:
        names = tar.getnames()
    for phase in ("compile", "correctness", "bench", "train", "tune", "profile"):
        assert f"gpu_check_logs/{phase}.log" in names
        assert report["phases"][phase]["ok"]
    env = report["env"]
    for key in ("python", "jax", "jaxlib", "device", "backend", "torch"):
        assert key in env
    assert report["telemetry"] == {"before": None, "during": None, "after": None}
    assert report["driver"] is None  # no nvidia-smi here
    kernels = report["kernels"]
    assert len(kernels) == 2
    for name, k in kernels.items():
        assert name.startswith("blockwise_fp8_matmul_bm")
        for key in ("lower_s", "compile_s", "first_run_s"):
            assert k[key] > 0
        for key in ("registers", "spill_store_bytes", "spill_load_bytes",
                    "wgmma_serialization_warnings", "ptxas_lines", "sass"):
            assert k[key] is None  # ptxas and nvdisasm run only on a GPU
    [c] = [r for s, r in report["correctness"].items() if s.startswith("matmul")]
    for dt in ("bfloat16", "float32"):
        for key in ("rel_fro_vs_float64", "max_abs_error", "worst_blocks",
                    "deepgemm_diff_vs_unquantized"):
            assert key in c[dt]
    [bench] = [r for s, r in report["bench"].items() if not s.startswith("grouped")]
    grouped = {s: r for s, r in report["bench"].items() if s.startswith("grouped")}
    assert grouped and all(r["ok"] and r["ratios"]["grouped_over_dense"] > 0
                           for r in grouped.values())
    assert [r["ok"] for s, r in report["correctness"].items() if s.startswith("grouped")
            ] == [True, True]  # the grouped forward's layouts; its gradients
    impls = bench["impls"]
    for name in ("pallas_fp8_bfloat16", "pallas_fp8_float32", "xla_bf16",
                 "xla_fp8_per_tensor"):
        t = impls[name]
        assert t["min_s"] <= t["median_s"] <= t["max_s"] and t["tflops_median"] > 0
    assert impls["torch_scaled_mm_blockwise"] is None and bench["torch_error"]
    assert bench["xla_fp8_uses_cublaslt_fp8"] is None  # a GPU-only fact
    for key, model in (("train", "transformer"), ("train_llama", "llama")):
        steps = report[key]["steps_per_s"]
        assert report[key]["model"] == model
        assert set(steps) == {"f32", "bf16-mixed", "fp8-current", "fp8-delayed",
                              "fp8-blockwise"}
        # the rehearsal's Llama stack runs one FP8 recipe (tools/gpu_check/train.py)
        ran = set(steps) if model == "transformer" else {"f32", "bf16-mixed", "fp8-current"}
        assert all(steps[k] > 0 for k in ran if k != "f32" or model == "llama")
    assert report["train"]["steps_per_s"]["f32"] is None  # the d_model-1024 step: no f32
    assert report["train_llama"]["steps_per_s"]["fp8-delayed"] is None
    assert report["train_llama"]["realistic"] is False  # the rehearsal size on CPU
    pt = report["per_tensor"]  # fmtkit's per-tensor GEMMs beside XLA bf16
    assert set(pt["impls"]) == {"fmtkit_per_tensor_gemm", "xla_bf16_gemm",
                                "fmtkit_current_fwd_bwd", "xla_bf16_fwd_bwd"}
    assert pt["gemm_uses_cublaslt_fp8"] is None and pt["fwd_bwd_cublaslt_fp8_calls"] is None
    assert report["fp8_rewriter_log"] == []  # XLA:CPU has no GEMM rewriter
    opt = report["optimizer"]  # the studies' optax chain beside plain adamw, tiny sizes
    assert opt["ok"] and opt["params"] == 2 * (64 * 64 + 64)
    for name in ("studies_chain", "optax_adamw"):
        t = opt["impls"][name]
        assert 0 < t["min_s"] <= t["median_s"] <= t["max_s"]
        assert opt["hlo_fusions"][name] > 0
    chain, plain = opt["impls"]["studies_chain"], opt["impls"]["optax_adamw"]
    assert opt["ratio_median"] == pytest.approx(chain["median_s"] / plain["median_s"])
    [tune] = [r for s, r in report["tune"].items() if not s.startswith("forms")]
    assert len(tune["configs"]) == 2
    # the opt-in kernel forms against the default, interleaved, with their agreement
    [forms] = [r for s, r in report["tune"].items() if s.startswith("forms")]
    assert forms["ok"] and set(forms["variants"]) == {"default", "smem_scales", "128x144",
                                                      "tile_epilogue", "cluster"}
    assert forms["variants"]["tile_epilogue"]["config"].endswith("_tile_epilogue")
    assert forms["variants"]["cluster"]["config"].endswith("_cluster2x1")
    for v in forms["variants"].values():
        assert v["tflops_median"] > 0 and v["rel_fro_vs_default"] < 2.0**-8  # bf16 out


@no_gpu
@pytest.mark.slow
def test_gpu_check_pytest_phase_parses_verdicts(tmp_path):
    """The last phase on a machine without a GPU: every compiled-mode test is collected and
    skipped; the verdicts are read from the verbose log."""
    r = kernel_tests.run_pytest(300, tmp_path / "pytest.log")
    assert r["ok"] and r["failures"] == []
    assert r["counts"]["SKIPPED"] >= 10 and r["counts"]["PASSED"] == 0
