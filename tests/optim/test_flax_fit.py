"""master_weights with the optax / Flax entry points users actually call: plain
``optax.apply_updates`` on a linen model, and ``nnx.Optimizer`` (whose ``update`` calls
``optax.apply_updates``) on an NNX model. 200 steps of a small bf16 model; after every step
every parameter must equal round(master) (``param_mismatches == 0``), checked again against
ml_dtypes' rounding of the f32 master at the end.

Not vacuous: each step also counts how many elements the previous design (bf16 deltas
``round(n - p)`` added in bf16) would have missed; the total must be nonzero.

The suite runs under strict dtype promotion; optax.adamw and optax.apply_updates of f32
deltas need JAX's default (standard) promotion, which the steps run under."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

from fmtkit import optim

nn = pytest.importorskip("flax.linen")
nnx = pytest.importorskip("flax.nnx")

STEPS = 200
LR = 3e-2  # large enough that parameters cross zero, where bf16 deltas are inexact
F32 = jnp.float32


def _data():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 8)).astype(np.float32)
    return jnp.asarray(x, jnp.bfloat16), jnp.asarray(np.sin(x.sum(-1)), F32)


def _bf16_delta_misses(old, new):
    """Elements where the previous design, ``old + bf16(new - old)`` rounded to bf16, would
    not land on ``new`` (explicit f32 arithmetic and casts: one rounding per step)."""
    total = jnp.zeros([], jnp.int32)
    for p, n in zip(jax.tree.leaves(old), jax.tree.leaves(new)):
        delta = (n.astype(F32) - p.astype(F32)).astype(jnp.bfloat16)
        old_way = (p.astype(F32) + delta.astype(F32)).astype(jnp.bfloat16)
        total = total + jnp.sum(old_way != n, dtype=jnp.int32)
    return total


def _assert_params_are_rounded_masters(params, state):
    p_leaves = jax.tree.leaves(params)
    m_leaves = jax.tree.leaves(state.master)
    assert len(p_leaves) == len(m_leaves) > 0
    for p, m in zip(p_leaves, m_leaves):
        p, m = np.asarray(p), np.asarray(m)
        assert p.dtype == ml_dtypes.bfloat16 and m.dtype == np.float32
        np.testing.assert_array_equal(p, m.astype(ml_dtypes.bfloat16))


class _LinenMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = jnp.tanh(nn.Dense(16, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)(x))
        return nn.Dense(1, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)(h)[..., 0]


def test_linen_with_plain_optax_apply_updates_200_steps():
    x, y = _data()
    model = _LinenMLP()
    params = jax.jit(model.init)(jax.random.key(0), x)["params"]
    opt = optim.dynamic_loss_scale(optim.master_weights(optax.adamw(LR)), init_scale=2.0**8)

    def loss_fn(p):
        return jnp.mean((model.apply({"params": p}, x).astype(F32) - y) ** 2)

    def step(carry, _):
        p, s = carry
        (_, loss), grads = jax.value_and_grad(
            lambda q: (optim.scale_loss(loss_fn(q), s), loss_fn(q)), has_aux=True)(p)
        updates, s = opt.update(grads, s, p)
        new = optax.apply_updates(p, updates)
        return (new, s), (loss, optim.param_mismatches(new, s), _bf16_delta_misses(p, new))

    with jax.numpy_dtype_promotion("standard"):
        (params, state), (loss, mismatches, old_misses) = jax.jit(
            lambda c: jax.lax.scan(step, c, None, length=STEPS))((params, opt.init(params)))
    assert np.all(np.asarray(mismatches) == 0)
    assert int(np.sum(old_misses)) > 0
    assert int(state.skipped_steps) == 0 and float(loss[-1]) < 0.5 * float(loss[0])
    _assert_params_are_rounded_masters(params, state.inner_state)


class _NnxMLP(nnx.Module):
    def __init__(self, rngs):
        kw = dict(dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, rngs=rngs)
        self.hidden = nnx.Linear(8, 16, **kw)
        self.out = nnx.Linear(16, 1, **kw)

    def __call__(self, x):
        return self.out(jnp.tanh(self.hidden(x)))[..., 0]


def test_nnx_optimizer_200_steps():
    x, y = _data()
    model = _NnxMLP(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optim.master_weights(optax.adamw(LR)), wrt=nnx.Param)

    @nnx.jit
    def train(model, optimizer):
        def body(carry, _):
            model, optimizer = carry
            old = nnx.as_pure(nnx.state(model, nnx.Param))  # arrays, not live Variables
            loss, grads = nnx.value_and_grad(
                lambda m: jnp.mean((m(x).astype(F32) - y) ** 2))(model)
            optimizer.update(model, grads)
            new = nnx.state(model, nnx.Param)
            stats = (loss, optim.param_mismatches(new, optimizer.opt_state),
                     _bf16_delta_misses(old, new))
            return (model, optimizer), stats

        # nnx.scan threads the graph state (parameters and optimizer) through the loop.
        scan = nnx.scan(body, length=STEPS, in_axes=(nnx.Carry, None), out_axes=(nnx.Carry, 0))
        return scan((model, optimizer), None)[1]

    with jax.numpy_dtype_promotion("standard"):
        loss, mismatches, old_misses = train(model, optimizer)
    assert np.all(np.asarray(mismatches) == 0)
    assert int(np.sum(old_misses)) > 0
    assert float(loss[-1]) < 0.5 * float(loss[0])
    # Outside jit, on the states as NNX keeps them: Param variables and OptVariable-wrapped
    # optimizer state, and on pure arrays.
    params = nnx.state(model, nnx.Param)
    assert int(optim.param_mismatches(params, optimizer.opt_state)) == 0
    assert int(optim.param_mismatches(nnx.to_pure_dict(params), optimizer.opt_state)) == 0
    opt_state = nnx.as_pure(optimizer.opt_state)
    _assert_params_are_rounded_masters(nnx.to_pure_dict(params), opt_state)
    # And it sees a parameter changed behind the optimizer's back.
    model.out.bias[...] = model.out.bias[...] + jnp.ones((), jnp.bfloat16)
    assert int(optim.param_mismatches(nnx.state(model, nnx.Param), optimizer.opt_state)) == 1
