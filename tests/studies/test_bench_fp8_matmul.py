"""The fp8-matmul benchmark (``fmtkit bench fp8-matmul``) on a machine without a GPU."""

import jax
import pytest

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
