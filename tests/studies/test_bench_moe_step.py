"""The moe-step benchmark (``fmtkit bench moe-step``): the no-GPU path, and the MoE layer
it times against a loop over tokens written here."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from studies.bench import moe_step

no_gpu = pytest.mark.skipif(jax.default_backend() == "gpu", reason="checks the no-GPU path")


@no_gpu
def test_bench_says_no_gpu_and_exits_0(capsys, tmp_path):
    assert moe_step.main(["--out", str(tmp_path)]) == 0
    assert "no GPU present" in capsys.readouterr().out
    assert not (tmp_path / "results.json").exists()


def test_bench_rejects_bad_arguments():
    with pytest.raises(SystemExit):
        moe_step.main(["--experts", "8,x"])
    with pytest.raises(SystemExit):
        moe_step.main(["--experts", "8,64", "--top-k", "2"])


@pytest.mark.slow
def test_moe_layer_matches_a_loop_over_tokens():
    """Routing, sorting, the grouped GEMMs and the scatter back, in float64 per token."""
    e, d, f, t, k = 4, 16, 8, 12, 2
    params = moe_step.init_params(jax.random.key(0), e, d, f)
    x = jax.random.normal(jax.random.key(1), (t, d), jnp.float32)
    with jax.default_matmul_precision("highest"):
        got = np.asarray(moe_step.moe_layer(params, x, top_k=k), np.float64)
    p = {n: np.asarray(v, np.float64) for n, v in params.items()}
    xs = np.asarray(x, np.float64)

    def silu(v):
        return v / (1 + np.exp(-v))

    def swiglu(v, up, down):
        h = v @ up
        return (silu(h[:f]) * h[f:]) @ down

    for i in range(t):
        logits = xs[i] @ p["router"]
        probs = np.exp(logits - logits.max())
        probs /= probs.sum()
        top = np.argsort(-probs)[:k]
        want = xs[i] + swiglu(xs[i], p["shared_up"], p["shared_down"])
        for j in top:
            want = want + probs[j] * swiglu(xs[i], p["up"][j], p["down"][j])
        # f32 products and sums of length <= 16 (HIGHEST precision): well within 1e-4
        np.testing.assert_allclose(got[i], want, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_steps_run_and_train_on_cpu():
    """The bf16-mixed and FP8 steps the benchmark times run here at a small size and lower
    the loss (the timing itself needs a GPU)."""
    params = moe_step.init_params(jax.random.key(0), 4, 128, 128)
    x = jax.random.normal(jax.random.key(1), (64, 128), jnp.float32)
    target = jnp.zeros_like(x)
    for variant in ("bf16-xla", "fp8-blockwise"):
        step, why = moe_step.make_step(variant, top_k=2, lr=0.1)
        assert why is None
        p, l0 = step(params, x, target)
        _, l1 = step(p, x, target)
        assert float(l1) < float(l0)
