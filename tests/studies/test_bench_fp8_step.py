"""Smoke test of ``fmtkit bench fp8-step`` at toy sizes (the timings themselves are a
benchmark, not a test): every variant runs, trains, and lands in the JSON."""

import json
import math

import pytest

from studies.bench import fp8_step as bench_fp8_step


@pytest.mark.slow  # about a minute on 2 cores: 16 train steps to compile
def test_bench_fp8_step_runs_every_variant(tmp_path, capsys):
    rc = bench_fp8_step.main([
        "--batch", "64", "--width", "96", "--layers", "1", "--d-model", "32", "--heads", "2",
        "--seq", "8", "--lm-batch", "2", "--repeats", "1", "--recipes", "current,delayed,mxfp8",
        "--dense-width", "64", "--dense-batch", "32", "--out", str(tmp_path)])
    assert rc == 0
    res = json.loads((tmp_path / "results.json").read_text())
    assert set(res["mlp"]["seconds"]) == {"f32", "bf16", "current", "delayed", "mxfp8",
                                          "flax-fp8"}
    assert set(res["transformer"]["seconds"]) == {"f32", "bf16", "current", "delayed",
                                                  "mxfp8"}
    # the dense model: nn.Dense with each dot_general vs Flax's op, f32, no bf16
    assert set(res["dense"]["seconds"]) == {"f32", "current", "delayed", "mxfp8", "flax-fp8"}
    for model in ("dense", "mlp"):  # Flax's op wherever the model has its seam
        assert res[model]["ratio_to_flax"]["flax-fp8"] == 1.0
        assert set(res[model]["ratio_to_flax"]) == set(res[model]["seconds"])
    for model in ("dense", "mlp", "transformer"):
        loss = res[model]["loss"]
        # Same data and initialisation: FP8 losses within 5% of the f32 loss (E4M3's 2^-4
        # relative rounding per operand averages out in a mean loss).
        for k, v in loss.items():
            assert math.isfinite(v) and abs(v - loss["f32"]) <= 0.05 * loss["f32"], (model, k)
        assert res[model]["ratio_to_f32"]["f32"] == 1.0
    assert res["mlp"]["ratio_to_bf16"]["bf16"] == 1.0
    # the machine's load is recorded with the numbers (they are measured on a shared CPU)
    assert all(len(res["load_average"][k]) == 3 for k in ("start", "end"))
    out = capsys.readouterr().out
    assert out.index("ratios to Flax's") > out.index("transformer")
    assert out.index("ratios to the bf16 step") > out.index("transformer")  # ratios last


def test_llama_configuration_has_llama_2_7b_block_widths():
    """The realistic configuration's parameters, counted by hand from the widths (Llama 2
    7B's block: hidden 4096, SwiGLU 11008, no biases) without running it; off GPUs the
    default size is the rehearsal one."""
    import jax

    size = bench_fp8_step.LLAMA
    assert (size["d_model"], size["ff"], size["layers"], size["tokens"]) == (4096, 11008, 4,
                                                                               8192)
    model = bench_fp8_step._Llama(size["d_model"], size["ff"], size["heads"], size["layers"])
    tokens = jax.ShapeDtypeStruct((size["tokens"] // size["seq"], size["seq"]), "int32")
    shapes = jax.eval_shape(model.init, jax.random.key(0), tokens)
    count = sum(math.prod(a.shape) for a in jax.tree.leaves(shapes))
    d, f, v = 4096, 11008, 256
    block = 4 * d * d + 3 * d * f + 2 * d  # q, k, v, o; gate, up, down; two RMSNorm scales
    assert count == 4 * block + 2 * v * d + d  # embedding, head, final norm
    if jax.default_backend() != "gpu":
        assert bench_fp8_step.llama_size(False) == (bench_fp8_step.LLAMA_REHEARSAL, False)
    assert bench_fp8_step.llama_size(True) == (size, True)


@pytest.mark.slow  # about a minute on 2 cores
def test_bench_fp8_step_llama_rehearsal_on_cpu(tmp_path, capsys):
    rc = bench_fp8_step.main(["--models", "llama", "--recipes", "current", "--repeats", "1",
                              "--out", str(tmp_path)])
    assert rc == 0
    res = json.loads((tmp_path / "results.json").read_text())["llama"]
    assert set(res["seconds"]) == {"f32", "bf16", "current"}
    assert res["realistic"] is False and res["size"] == bench_fp8_step.LLAMA_REHEARSAL
    assert "a rehearsal size" in capsys.readouterr().out
