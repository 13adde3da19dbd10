"""FP8 recipes under the per-example form, ``jax.vmap(with_policy(f, preset), in_axes=(None,
0))``: each call of the policied function maps one example, ``jax.vmap`` batches them.

Delayed scaling shares one amax history across the batch (the history is not mapped): its
scales come from that history, and what the batch observed is recorded as the batch amax,
the max over the examples (as ``fmtkit.fp8.combine_observations`` combines micro-batches),
never their sum. References: a float64 NumPy emulation that takes the batch amaxes directly.

Current scaling quantizes what each call sees: one scale per example (each call's tensor is
one example's), checked against an ml_dtypes emulation with per-example scales; the batched
form (``jax.vmap`` inside the policied function) gives one scale per batch.
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from fmtkit import fp8, with_policy

pytestmark = pytest.mark.slow  # each test compiles training steps (seconds)

E4M3_MAX = 448.0  # float8_e4m3fn's largest finite value (OCP FP8 spec)


def _model(p, x):  # one example [8] -> [4]; the second matmul is the output head
    return (x @ p["w1"]) @ p["w2"]


def _setup():
    k = jax.random.split(jax.random.key(0), 2)
    xs = jax.random.normal(k[0], (4, 8)) * jnp.array([[1.0], [3.0], [0.5], [2.0]])
    p = {"w1": jax.random.normal(k[1], (8, 16)),
         "w2": jnp.full((16, 4), 0.25)}  # rows sum to 1: the first GEMM's grad is c_b
    c = jnp.array([0.5, 8.0, 2.0, 1.0])  # per-example loss weights (exact in bf16 and e5m2)
    return p, xs, c


def _bf16(a):
    return np.asarray(a, np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)


def _emulated_observation(p, xs, c):
    """The batch amaxes of the first GEMM's x, w (its operands as it receives them: in the
    compute dtype, bf16) and output gradient, in float64 NumPy: the loss sum_b c_b * sum(y_b)
    gives that GEMM's output gradient c_b * rowsum(w2) = c_b."""
    xs64, w1 = _bf16(xs), _bf16(p["w1"])
    g = np.asarray(c, np.float64)[:, None] * np.asarray(p["w2"], np.float64).sum(1)[None]
    return np.array([np.abs(xs64).max(), np.abs(w1).max(), np.abs(g).max()])


def test_delayed_history_records_the_batch_amax_not_the_sum():
    p, xs, c = _setup()
    f = with_policy(_model, "fp8-delayed")
    state = f.init_fp8_state(p, xs[0])
    batched = jax.vmap(lambda p, x, s: f(p, x, fp8_state=s), in_axes=(None, 0, None))

    def loss(s):
        return jnp.sum(c[:, None] * batched(p, xs, s))

    history = np.zeros((3, 1024))
    for _ in range(2):  # the bootstrap step, then one that scales from the history
        observed = jax.jit(jax.grad(loss))(state)
        state = fp8.update_state(state, observed)
        history = np.roll(history, 1, axis=1)
        history[:, 0] = _emulated_observation(p, xs, c)
        (got,) = state.values()
        np.testing.assert_array_equal(np.asarray(got, np.float64), history.astype(np.float32))
    # Negative control: the sum over the examples (what a plain vmap of the gradient gives)
    # is not what was recorded.
    xs64 = np.abs(_bf16(xs)).max(1)
    assert abs(xs64.sum() - history[0, 0]) > 1.0


def test_delayed_per_seed_states_stay_per_seed():
    """A mapped history (one state per seed: ``in_axes=0`` on the state) keeps one
    observation per seed, each the amax of that seed's batch."""
    p, xs, c = _setup()
    f = with_policy(_model, "fp8-delayed")
    state = f.init_fp8_state(p, xs[0])
    seeds = jax.tree.map(lambda h: jnp.stack([h, h]), state)
    batch2 = jnp.stack([xs, 2.0 * xs])  # [seed, example, 8]
    per_example = jax.vmap(lambda p, x, s: f(p, x, fp8_state=s), in_axes=(None, 0, None))
    per_seed = jax.vmap(per_example, in_axes=(None, 0, 0))

    def loss(s):
        return jnp.sum(c[None, :, None] * per_seed(p, batch2, s))

    (got,) = jax.grad(loss)(seeds).values()
    for i in range(2):
        want = _emulated_observation(p, batch2[i], c)
        np.testing.assert_array_equal(np.asarray(got[i, :, 0], np.float64),
                                      want.astype(np.float32))


def _e4m3_qdq(a, amax):
    """a quantized to E4M3 with the per-tensor scale amax * f32(1 / 448), multiplied by the
    scale's f32 reciprocal (fmtkit.scaling's documented rule), dequantized (float64)."""
    scale = np.float32(amax) * np.float32(1.0 / E4M3_MAX)
    q = np.clip(np.asarray(a, np.float32) * (np.float32(1.0) / scale), -E4M3_MAX, E4M3_MAX)
    return q.astype(ml_dtypes.float8_e4m3fn).astype(np.float64) * np.float64(scale)


def test_current_scaling_is_per_example_in_the_per_example_form():
    p, xs, _ = _setup()
    # A residual input breaks the head's chain: the first GEMM's output is the model's output.
    f = with_policy(lambda p, x, z: x @ p["w1"] + z, "fp8-current")
    z = jnp.zeros((16,), jnp.bfloat16)
    got = np.asarray(jax.jit(jax.vmap(f, in_axes=(None, 0, None)))(p, xs, z), np.float64)
    # (the GEMM's operands are cast to the compute dtype, bf16, before they are quantized)
    w1, xs_bf16 = _bf16(p["w1"]), _bf16(xs)
    qw = _e4m3_qdq(w1, np.abs(w1).max())
    per_example = np.stack([_bf16(_e4m3_qdq(x, np.abs(x).max()) @ qw) for x in xs_bf16])
    # 8 exact FP8 products accumulated in f32, rounded once to bf16: at most one bf16 ulp.
    np.testing.assert_allclose(got, per_example, rtol=2**-7, atol=0)
    # Negative control: one scale for the whole batch gives other values for the three
    # examples whose amax is not the batch's.
    amax = np.abs(xs_bf16).max()
    per_batch = np.stack([_bf16(_e4m3_qdq(x, amax) @ qw) for x in xs_bf16])
    assert int((np.abs(per_batch - got).max(1) > 0).sum()) == 3
