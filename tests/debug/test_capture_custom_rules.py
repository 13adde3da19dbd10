"""``fmtkit.debug`` on a model with a user's ``jax.custom_vjp`` or ``jax.custom_jvp`` layer
(JAX's documented idiom: the forward rule calls the function itself).

The GEMM inside such a layer is differentiated by the user's rule, not by JAX, so its
statistics cannot leave the step: they are NaN ("no data"), with a warning naming the GEMM;
its override still applies. Every other GEMM keeps its names and statistics, which equal a
float64 NumPy computation of its tensors, eagerly and under ``jax.jit``; a rule selecting
only other GEMMs works.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import fmtkit.debug as debug
from fmtkit import with_policy

pytestmark = pytest.mark.slow  # each test compiles training steps (a few seconds)


@jax.custom_vjp
def dense_vjp(x, w):
    return x @ w


def _fwd(x, w):
    return dense_vjp(x, w), (x, w)


def _bwd(res, g):
    x, w = res
    return g @ w.T, x.T @ g


dense_vjp.defvjp(_fwd, _bwd)


@jax.custom_jvp
def dense_jvp(x, w):
    return x @ w


@dense_jvp.defjvp
def _dense_jvp(primals, tangents):
    (x, w), (dx, dw) = primals, tangents
    return dense_jvp(x, w), dx @ w + x @ dw


k = jax.random.split(jax.random.key(0), 4)
PARAMS = {"a": jax.random.normal(k[0], (8, 16)), "b": jax.random.normal(k[1], (16, 16)),
          "out": jax.random.normal(k[2], (16, 4))}
X = jax.random.normal(k[3], (32, 8))
BF16 = ml_dtypes.bfloat16


def setup(layer, gemm=None):
    def f(params, x):
        h = jnp.tanh(layer(x, params["a"]))  # the custom layer: GEMM dot_general_0
        return jnp.tanh(h @ params["b"]) @ params["out"]  # dot_general_1, the head

    model = with_policy(f, "bf16-mixed")
    cfg = debug.DebugConfig([debug.Rule("", gemm=gemm, tensors=("activation", "weight",
                                                                "output_grad"),
                                        stats=("amax",))])

    def loss(p):
        return jnp.sum(model(p, X).astype(jnp.float32))

    state = debug.init(cfg, loss, PARAMS)

    def step(p, s):
        def g(p, s):
            with debug.capture(cfg, s, 0):
                return loss(p)
        return jax.grad(g, argnums=(0, 1))(p, s)

    return state, step


def reference():
    """The amax of dot_general_1's activation tanh(bf16(x @ a)) and weight b, by NumPy on
    bf16-rounded values (bf16-mixed: bf16 operands, bf16 results)."""
    def bf(v):
        return np.asarray(v, np.float32).astype(BF16).astype(np.float64)
    y0 = (bf(X) @ bf(PARAMS["a"])).astype(np.float32).astype(BF16).astype(np.float64)
    h = np.tanh(y0).astype(np.float32).astype(BF16).astype(np.float64)
    return {"activation": np.abs(h).max(), "weight": np.abs(bf(PARAMS["b"])).max()}


@pytest.mark.parametrize("layer", [dense_vjp, dense_jvp], ids=["custom_vjp", "custom_jvp"])
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_a_custom_layer_has_no_data_and_the_others_their_statistics(layer, jit):
    state, step = setup(layer)
    assert sorted(state[""]) == ["dot_general_0", "dot_general_1", "dot_general_2"]
    with pytest.warns(UserWarning, match=r"GEMM ''/dot_general_0 runs inside a "
                      r"jax.custom_vjp or jax.custom_jvp.*NaN"):
        grads, stats = (jax.jit(step) if jit else step)(PARAMS, state)
    stats = jax.device_get(stats)[""]
    assert all(np.isnan(v["amax"]) for v in stats["dot_general_0"].values())
    want = reference()
    for tensor in ("activation", "weight"):
        assert stats["dot_general_1"][tensor]["amax"] == np.float32(want[tensor])
    assert np.isfinite(stats["dot_general_1"]["output_grad"]["amax"])
    # The parameter gradients are the ones without fmtkit.debug.
    model_grads = jax.grad(lambda p: jnp.sum(with_policy(
        lambda q, x: jnp.tanh(jnp.tanh(layer(x, q["a"])) @ q["b"]) @ q["out"],
        "bf16-mixed")(p, X).astype(jnp.float32)))(PARAMS)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(model_grads)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("layer", [dense_vjp, dense_jvp], ids=["custom_vjp", "custom_jvp"])
def test_a_rule_for_another_gemm_works_beside_a_custom_layer(layer):
    state, step = setup(layer, gemm="dot_general_1")
    assert list(state[""]) == ["dot_general_1"]
    _, stats = jax.jit(step)(PARAMS, state)
    want = reference()
    for tensor in ("activation", "weight"):
        assert stats[""]["dot_general_1"][tensor]["amax"] == np.float32(want[tensor])
