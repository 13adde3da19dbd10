"""Equinox models under a policy, written as Equinox users write them: an ``eqx.Module``
of ``eqx.nn.Linear`` and ``eqx.nn.MLP`` that maps one example, batched with
``jax.vmap(model)(x)``, trained with ``eqx.filter_jit`` and ``eqx.filter_value_and_grad``
(or split with ``eqx.partition`` / ``eqx.combine``). The policy wraps the function
``lambda model, x: jax.vmap(model)(x)``, whose first argument (the model) holds the
parameters. References: the unwrapped model (fp32, bit for bit) and bf16 roundings by
ml_dtypes in float64 NumPy.

(fmtkit.debug's statistics of an Equinox model against float64 NumPy:
tests/debug/test_capture_stats.py, case "equinox".)
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from jaxpr_utils import dot_operand_dtypes

from fmtkit import with_policy

F32, BF16 = jnp.float32, jnp.bfloat16


class Net(eqx.Module):
    """A projection and an MLP (two hidden layers): four ``eqx.nn.Linear`` GEMMs, the last
    one the output head."""

    proj: eqx.nn.Linear
    mlp: eqx.nn.MLP

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.proj = eqx.nn.Linear(12, 32, key=k1)
        self.mlp = eqx.nn.MLP(32, 4, width_size=48, depth=2, activation=jax.nn.gelu, key=k2)

    def __call__(self, x):  # one example [12] -> [4]
        return self.mlp(jnp.tanh(self.proj(x)))


def _data():
    k = jax.random.split(jax.random.key(7), 2)
    x = jax.random.normal(k[0], (64, 12))
    y = jnp.sin(x[:, :4] * 1.5) + 0.1 * jax.random.normal(k[1], (64, 4))
    return x, y


def _loss_fn(forward):
    def loss(model, x, y):
        return jnp.mean(jnp.square(forward(model, x).astype(F32) - y))

    return loss


def _policied(preset):
    return with_policy(lambda model, x: jax.vmap(model)(x), preset)


def _unwrapped(model, x):
    return jax.vmap(model)(x)


def _train(forward, model, steps, style="filter"):
    """Adam steps on ``_data``: ``style="filter"`` jits and differentiates the model with
    ``eqx.filter_jit`` / ``eqx.filter_value_and_grad``; ``"partition"`` splits it with
    ``eqx.partition`` into arrays and the rest and uses ``jax.jit`` / ``jax.value_and_grad``
    on the arrays, ``eqx.combine`` putting them back."""
    loss = _loss_fn(forward)
    opt = optax.adam(3e-3)
    with jax.numpy_dtype_promotion("standard"):
        opt_state = opt.init(eqx.filter(model, eqx.is_array))

    def update(grads, opt_state, params):
        with jax.numpy_dtype_promotion("standard"):  # optax's bias correction mixes types
            updates, opt_state = opt.update(grads, opt_state, params)
        return updates, opt_state

    if style == "filter":
        @eqx.filter_jit
        def step(model, opt_state, x, y):
            value, grads = eqx.filter_value_and_grad(loss)(model, x, y)
            updates, opt_state = update(grads, opt_state, eqx.filter(model, eqx.is_array))
            return eqx.apply_updates(model, updates), opt_state, value, grads
    else:
        _, static = eqx.partition(model, eqx.is_array)

        @jax.jit
        def step_arrays(params, opt_state, x, y):
            value, grads = jax.value_and_grad(
                lambda p: loss(eqx.combine(p, static), x, y))(params)
            updates, opt_state = update(grads, opt_state, params)
            return eqx.apply_updates(params, updates), opt_state, value, grads

        def step(model, opt_state, x, y):
            params, opt_state, value, grads = step_arrays(
                eqx.filter(model, eqx.is_array), opt_state, x, y)
            return eqx.combine(params, static), opt_state, value, grads

    x, y = _data()
    losses = []
    for _ in range(steps):
        model, opt_state, value, grads = step(model, opt_state, x, y)
        losses.append(float(value))
    return model, losses, grads


def _policied_per_example(preset):
    """The policy on one example's call, ``jax.vmap`` around it: ``jax.vmap(policied,
    in_axes=(None, 0))(model, x)``."""
    return jax.vmap(with_policy(lambda model, x: model(x), preset), in_axes=(None, 0))


# Both forms train: the FP8 case takes the per-example form, the bf16 one the batched form
# (the batched form under fp8-current: test_equinox_gru.py).
@pytest.mark.parametrize("preset, style, fp8_dots", [("bf16-mixed", "filter", 0),
                                                     ("fp8-current", "partition", 3)])
def test_an_equinox_model_trains_under_a_policy(preset, style, fp8_dots):
    forward = _policied(preset) if fp8_dots == 0 else _policied_per_example(preset)
    model = Net(jax.random.key(0))
    trained, losses, grads = _train(forward, model, 60, style)
    assert losses[-1] < 0.5 * losses[0], losses[::10]
    # Parameters and their gradients stay f32 (the master copy the presets promise); the
    # activation functions, non-array leaves, come back as they were.
    for tree in (trained, grads):
        assert {a.dtype for a in jax.tree.leaves(eqx.filter(tree, eqx.is_array))} == {
            jnp.dtype(F32)}
    assert trained.mlp.activation is jax.nn.gelu
    # The user's model is left alone.
    assert all(bool((a == b).all()) for a, b in zip(
        jax.tree.leaves(eqx.filter(model, eqx.is_array)),
        jax.tree.leaves(eqx.filter(Net(jax.random.key(0)), eqx.is_array))))
    # The forward GEMMs run as the preset says: the three hidden ones in bf16 (or FP8), the
    # head in bf16.
    x, _ = _data()
    params, static = eqx.partition(model, eqx.is_array)
    closed = jax.make_jaxpr(lambda p: forward(eqx.combine(p, static), x))(params)
    dots = [tuple(jnp.dtype(d).name for d in ds) for ds in dot_operand_dtypes(closed)]
    e4m3 = ("float8_e4m3fn",) * 2
    assert dots.count(e4m3) == fp8_dots
    assert dots.count(("bfloat16",) * 2) == 4 - fp8_dots and len(dots) == 4


def test_fp32_is_the_unwrapped_model_bit_for_bit():
    model = Net(jax.random.key(1))
    x, y = _data()
    got = eqx.filter_jit(eqx.filter_value_and_grad(_loss_fn(_policied("fp32"))))(model, x, y)
    ref = eqx.filter_jit(eqx.filter_value_and_grad(_loss_fn(_unwrapped)))(model, x, y)
    assert np.asarray(got[0]) == np.asarray(ref[0])
    for a, b in zip(jax.tree.leaves(got[1]), jax.tree.leaves(ref[1])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # And over training steps.
    _, l_got, _ = _train(_policied("fp32"), model, 5)
    _, l_ref, _ = _train(_unwrapped, model, 5)
    assert l_got == l_ref


def test_partitioned_parameters_and_bf16_numerics_against_numpy():
    """``eqx.partition`` / ``eqx.combine`` with ``jax.jit`` and ``jax.grad`` (the arrays
    alone differentiated): bf16-mixed's output head equals float64 NumPy on bf16-rounded
    operands (bf16 x bf16 into f32 logits, the bias, a parameter, cast to bf16 at use)."""
    lin = eqx.nn.Linear(12, 4, key=jax.random.key(3))
    params, static = eqx.partition(lin, eqx.is_array)
    forward = _policied("bf16-mixed")
    x, y = _data()

    def loss(p):
        return jnp.mean(jnp.square(forward(eqx.combine(p, static), x).astype(F32) - y))

    value, grads = jax.jit(jax.value_and_grad(loss))(params)
    assert grads.weight.dtype == F32 and grads.weight.shape == (4, 12)

    def bf16(a):
        return np.asarray(a, np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)

    out = jax.jit(lambda p: forward(eqx.combine(p, static), x))(params)
    assert out.dtype == F32
    want = bf16(x) @ bf16(lin.weight).T + bf16(lin.bias)
    # 12 exact bf16 products summed in f32, one f32 add: a few f32 ulps.
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-6, atol=1e-6)
    # Negative control: the f32 bias is not what the head adds.
    assert np.abs(np.asarray(out) - (want - bf16(lin.bias) + np.asarray(
        lin.bias, np.float64))).max() > 1e-5
    np.testing.assert_allclose(float(value), np.mean((want - np.asarray(y, np.float64)) ** 2),
                               rtol=1e-6)
