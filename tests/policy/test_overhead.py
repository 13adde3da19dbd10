"""The policy's own overhead: one cotangent rounding per value, eager calls traced once.

References are independent of the interpreter: the rounded cotangent is derived by hand
(float64 NumPy, the bf16 rounding by ml_dtypes), and the dedup is compared bit for bit with
the one-rounding-per-module behaviour it replaces (the private switch
``SWITCHES.dedup_cotangent``).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from jax import lax

from fmtkit._switches import flipped
from fmtkit.policy import Policy, with_policy
from fmtkit.policy._engine import caches

# Every module: f32 storage, compute and outputs, cotangents rounded to bf16 (the only
# setting where a value leaving nested modules is wrapped, since o=f32 is wider than g).
G_BF16 = Policy.parse("p=f32,c=f32,o=f32,g=bf16")


class Inner(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(3, name="dense")(x)


class Middle(nn.Module):
    @nn.compact
    def __call__(self, x):
        return Inner(name="inner")(x)


class Outer(nn.Module):
    @nn.compact
    def __call__(self, x):
        return Middle(name="middle")(x)


class NnxOuter(nnx.Module):
    def __init__(self, rngs):
        self.middle = NnxMiddle(rngs)

    def __call__(self, x):
        return self.middle(x)


class NnxMiddle(nnx.Module):
    def __init__(self, rngs):
        self.dense = nnx.Linear(4, 3, rngs=rngs)

    def __call__(self, x):
        return self.dense(x)


def _x():
    return jax.random.normal(jax.random.key(1), (5, 4), jnp.float32) * 3.0


def _roundings(closed) -> int:
    """``round_cotangent`` calls (custom_jvp_call equations) at any depth of a jaxpr."""
    n = 0
    for eqn in closed.jaxpr.eqns:
        if eqn.primitive.name == "custom_jvp_call":
            n += 1
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            n += _roundings(sub if hasattr(sub, "jaxpr") else jax.extend.core.ClosedJaxpr(sub, ()))
    return n


# A new loss function per use: make_jaxpr and jit cache traces by function identity, and
# the private switch is read at trace time.
@pytest.fixture(scope="module")
def linen_case():
    policied = with_policy(Outer(), G_BF16)
    x = _x()
    params = jax.jit(Outer().init)(jax.random.key(0), x)["params"]

    def make_loss():
        return lambda p: jnp.sum(jnp.sin(policied.apply({"params": p}, x)))

    return make_loss, params, x


def test_nested_modules_round_a_value_once(linen_case):
    make_loss, params, _ = linen_case
    # The Dense output leaves dense, inner, middle and the root: one rounding, not four.
    assert _roundings(jax.make_jaxpr(make_loss())(params)) == 1
    with flipped(dedup_cotangent=False):
        assert _roundings(jax.make_jaxpr(make_loss())(params)) == 4


def test_dedup_gradients_bit_identical_and_match_hand_rounding(linen_case):
    make_loss, params, x = linen_case
    grads = jax.jit(jax.grad(make_loss()))(params)
    with flipped(dedup_cotangent=False):
        undeduped = jax.jit(jax.grad(make_loss()))(params)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(undeduped)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # By hand: y = x W + b; dL/dy = cos(y), rounded to bf16 once; dW = x^T dy, db = sum dy.
    d = params["middle"]["inner"]["dense"]
    w, b = np.asarray(d["kernel"], np.float64), np.asarray(d["bias"], np.float64)
    xs = np.asarray(x, np.float64)
    y = (xs @ w + b).astype(np.float32)
    dy = np.cos(y.astype(np.float64)).astype(np.float32).astype(ml_dtypes.bfloat16)
    dy = dy.astype(np.float64)
    g = grads["middle"]["inner"]["dense"]
    np.testing.assert_allclose(np.asarray(g["kernel"]), xs.T @ dy, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(g["bias"]), dy.sum(0), rtol=1e-5, atol=1e-5)
    # The rounding is there (an unrounded cotangent gives a different kernel gradient).
    exact = xs.T @ np.cos(y.astype(np.float64))
    assert np.max(np.abs(exact - xs.T @ dy)) > 1e-3


def test_nnx_nested_dedup_bit_identical():
    model = NnxOuter(nnx.Rngs(0))
    policied = with_policy(model, G_BF16)
    graphdef, params, rest = nnx.split(policied, nnx.Param, ...)
    x = _x()

    def make_loss():
        return lambda p: jnp.sum(jnp.sin(nnx.merge(graphdef, p, rest)(x)))

    assert _roundings(jax.make_jaxpr(make_loss())(params)) == 1
    grads = jax.jit(jax.grad(make_loss()))(params)
    with flipped(dedup_cotangent=False):
        # NNX scopes the sub-modules (dense, middle), not the root: two without the dedup.
        assert _roundings(jax.make_jaxpr(make_loss())(params)) == 2
        undeduped = jax.jit(jax.grad(make_loss()))(params)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(undeduped)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ---------------------------------------------------------------------------------------------
# Eager calls: traced (and interpreted) once per input signature.

BF16_MIXED = "bf16-mixed"


TRACES: list = []  # one entry per run of a model's Python code (a trace, or an eager call)


class CountingMLP(nn.Module):
    @nn.compact
    def __call__(self, x, scale=1.0):
        TRACES.append(1)
        h = nn.relu(nn.Dense(8)(x)) * scale
        return nn.Dense(3)(h)


def test_linen_eager_apply_traces_once_per_signature():
    # The trace cache off: every trace (the eager cache's, jit's) runs the model's Python.
    policied = with_policy(CountingMLP(), BF16_MIXED, cache_traces=False)
    x = _x()
    variables = jax.jit(policied.init)(jax.random.key(0), x)
    counter = TRACES
    counter.clear()
    first = policied.apply(variables, x)
    second = policied.apply(variables, x + 1.0)
    assert len(counter) == 1
    # What jit of the same call computes (the reference: the policied trace, compiled).
    ref = jax.jit(policied.apply)(variables, x + 1.0)
    np.testing.assert_array_equal(np.asarray(second), np.asarray(ref))
    assert first.dtype == ref.dtype == jnp.float32
    # A static argument of another value, or another shape, is another signature.
    policied.apply(variables, x, scale=2.0)
    assert len(counter) == 3  # the new scale, and jit's own trace above
    policied.apply(variables, x[:2])
    assert len(counter) == 4
    policied.apply(variables, x, scale=2.0)
    assert len(counter) == 4


def test_linen_eager_apply_mutable_collections():
    policied = with_policy(nn.BatchNorm(use_running_average=False), BF16_MIXED)
    x = _x()
    variables = policied.init(jax.random.key(0), x)
    out, updates = policied.apply(variables, x, mutable=["batch_stats"])
    ref_out, ref_updates = jax.jit(policied.apply, static_argnames="mutable")(
        variables, x, mutable=("batch_stats",))
    np.testing.assert_array_equal(np.asarray(out), np.asarray(ref_out))
    mean = np.asarray(updates["batch_stats"]["mean"])
    np.testing.assert_array_equal(mean, np.asarray(ref_updates["batch_stats"]["mean"]))
    # Running mean after one step of momentum 0.99 from zero: 0.01 * batch mean (float64).
    np.testing.assert_allclose(mean, 0.01 * np.asarray(x, np.float64).mean(0), rtol=1e-5)


def test_function_eager_call_traces_once():
    counter: list = []

    def apply(params, x):
        counter.append(1)
        return jnp.tanh(x @ params["w"])

    policied = with_policy(apply, BF16_MIXED, cache_traces=False)
    params = {"w": jnp.ones((4, 3), jnp.float32) * 0.25}
    x = _x()
    a = policied(params, x)
    b = policied(params, x)
    assert len(counter) == 1
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # Under a transform the call is traced as before (the cache is for eager calls only).
    jax.grad(lambda p: jnp.sum(policied(p, x)))(params)
    assert len(counter) == 2


class NnxCounting(nnx.Module):
    def __init__(self, rngs):
        self.dense = nnx.Linear(4, 3, rngs=rngs)
        self.calls = nnx.BatchStat(jnp.zeros((), jnp.float32))

    def __call__(self, x):
        TRACES.append(1)
        self.calls[...] = self.calls[...] + 1.0
        return self.dense(x)


def test_nnx_eager_call_traces_once_and_writes_state_back():
    model = NnxCounting(nnx.Rngs(0))
    counter = TRACES
    counter.clear()
    policied = with_policy(model, BF16_MIXED)
    kernel = model.dense.kernel.get_value()
    x = _x()
    first = policied(x)
    second = policied(x)
    assert len(counter) == 1
    np.testing.assert_array_equal(np.asarray(first), np.asarray(second))
    # The changed Variable is written back (shared with the user's model), per call; the
    # Params it did not change are not rewritten.
    assert float(model.calls.get_value()) == 2.0
    assert model.dense.kernel.get_value() is kernel
    # The output is the policied computation: bf16 operands, f32 accumulation, output bf16
    # (float64 NumPy on bf16-rounded operands, then rounded to bf16).
    bf = ml_dtypes.bfloat16
    w = np.asarray(kernel).astype(bf).astype(np.float64)
    xs = np.asarray(x).astype(bf).astype(np.float64)
    b = np.asarray(model.dense.bias.get_value()).astype(bf).astype(np.float64)
    np.testing.assert_allclose(np.asarray(first, np.float64), xs @ w + b, rtol=2e-2, atol=2e-2)


# ---------------------------------------------------------------------------------------------
# Trace time: each rebuilt equation is bound through a shared jax.jit (JAX_EARLY inlining).


@jax.custom_vjp
def _scaled(x, w):
    return x @ w


_scaled.defvjp(lambda x, w: (x @ w, (x, w)), lambda r, g: (g @ r[1].T, r[0].T @ g))


def _bodies(params, x):
    """A function with a jit, a cond, a scan and a custom_vjp around matmuls."""
    h = jax.jit(lambda a: jnp.tanh(a @ params["w"]))(x)
    h = lax.cond(jnp.sum(h) > 0, lambda a: _scaled(a, params["v"]), lambda a: a * 2.0, h)

    def body(c, _):
        return jax.nn.gelu(c @ params["v"]), jnp.sum(c)

    h, ys = lax.scan(body, h, None, length=2)
    return jax.nn.log_softmax(h).sum() + ys.sum()


def _policied_grad_jaxpr(case_fn) -> str:
    return str(jax.make_jaxpr(case_fn())(*case_fn.args))


def _cases():
    from policy_testlib import build, init_params

    out = []
    for api, name, preset in (("linen", "lm_moe_tied", "bf16-mixed"),
                              ("linen", "lm", "fp8-current"), ("nnx", "moe", "fp16-mixed")):
        case = build(api, name)
        policied = with_policy(case.model, preset)
        if api == "linen":
            params = init_params(case)

            def make(policied=policied, case=case):
                return jax.value_and_grad(
                    lambda p: case.loss_fn(policied.apply({"params": p}, *case.inputs)))
        else:
            graphdef, params, rest = nnx.split(policied, nnx.Param, ...)

            def make(graphdef=graphdef, rest=rest, case=case):
                return jax.value_and_grad(
                    lambda p: case.loss_fn(nnx.merge(graphdef, p, rest)(*case.inputs)))
        make.args = (params,)
        out.append(make)
    fn = with_policy(_bodies, "bf16-mixed")
    params = {"w": jnp.full((4, 3), 0.25, jnp.float32), "v": jnp.eye(3, dtype=jnp.float32)}

    def make_fn():
        return jax.value_and_grad(fn)

    make_fn.args = (params, _x())
    out.append(make_fn)
    return out


def test_jitted_primitives_leave_the_program_unchanged():
    """Binding each rebuilt equation through a shared ``jit`` only changes how JAX
    linearizes it while tracing: the jaxpr of loss + gradient is the same text as with
    every equation bound directly (so the compiled program and its numbers are the same),
    on linen and NNX models under bf16, fp16 and FP8 presets and a function with jit, cond,
    scan and custom_vjp bodies."""
    cases = _cases()
    with_jit = [_policied_grad_jaxpr(c) for c in cases]
    assert caches.jitted_primitive.cache_info().currsize > 0  # the path was taken
    with flipped(jit_primitives=False):
        direct = [_policied_grad_jaxpr(c) for c in cases]
    for a, b in zip(with_jit, direct):
        assert a == b
    # Negative control: a jit that is not inlined while tracing shows in the jaxpr.
    with flipped(jit_inline=jax.Inline.JAX_LATE):
        assert _policied_grad_jaxpr(cases[0]) != direct[0]


# ---------------------------------------------------------------------------------------------
# The model's trace, kept per input signature (cache_traces=True, the default).


class Counted(nn.Module):
    """Counts the runs of its Python (``TRACES``); ``scale`` is a static argument."""

    @nn.compact
    def __call__(self, x, scale=1.0):
        TRACES.append(1)
        h = jax.nn.gelu(nn.Dense(8)(x))
        return nn.Dense(3)(nn.LayerNorm()(h)) * scale


def _linen_grads(policied, variables, x, **kwargs):
    """Loss and gradients through a fresh jit (a new trace of the step every call)."""
    def loss(v):
        return jnp.sum(jnp.sin(policied.apply(v, x, **kwargs)))

    return jax.jit(jax.value_and_grad(loss))(variables)


@pytest.fixture(scope="module")
def counted_case():
    x = _x()
    variables = jax.jit(Counted().init)(jax.random.key(0), x)
    return x, variables


def test_trace_cache_hit_runs_the_model_once_and_is_bit_identical(counted_case):
    x, variables = counted_case
    policied = with_policy(Counted(), BF16_MIXED)
    TRACES.clear()
    first = _linen_grads(policied, variables, x)
    second = _linen_grads(policied, variables, x)  # a fresh jit: a second trace
    assert len(TRACES) == 1
    # Without the cache the Python runs per trace, and every number is the same.
    uncached = with_policy(Counted(), BF16_MIXED, cache_traces=False)
    ref = _linen_grads(uncached, variables, x)
    _linen_grads(uncached, variables, x)
    assert len(TRACES) == 3
    for a, b, c in zip(jax.tree.leaves(first), jax.tree.leaves(second), jax.tree.leaves(ref)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(c))
        np.testing.assert_array_equal(np.asarray(b), np.asarray(c))
    # The policy is applied on the hit too: the Dense matmuls take bf16 operands.
    jaxpr = jax.make_jaxpr(lambda v: policied.apply(v, x))(variables)
    assert len(TRACES) == 3
    dots = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "dot_general"]
    assert dots and all(e.invars[0].aval.dtype == jnp.bfloat16 for e in dots)


def test_trace_cache_misses_on_shape_dtype_static_arg_and_policy(counted_case):
    x, variables = counted_case
    policied = with_policy(Counted(), BF16_MIXED)
    TRACES.clear()
    _linen_grads(policied, variables, x)
    _linen_grads(policied, variables, x[:2])  # another shape
    assert len(TRACES) == 2
    _linen_grads(policied, variables, x.astype(jnp.bfloat16))  # another dtype
    assert len(TRACES) == 3
    l2, _ = _linen_grads(policied, variables, x, scale=2.0)  # another static value
    assert len(TRACES) == 4
    l3, _ = _linen_grads(policied, variables, x, scale=3)  # 3 == 3.0: but an int
    assert len(TRACES) == 5
    _linen_grads(policied, variables, x, scale=2.0)  # each is kept
    _linen_grads(policied, variables, x[:2])
    assert len(TRACES) == 5
    # The static value is the traced one (not the first one kept).
    assert float(l2) != float(l3)
    # Another policy on the same model: its own traces (and its own casts).
    other = with_policy(Counted(), "fp32")
    _linen_grads(other, variables, x)
    assert len(TRACES) == 6
    dots = [e for e in jax.make_jaxpr(lambda v: other.apply(v, x))(variables).jaxpr.eqns
            if e.primitive.name == "dot_general"]
    assert all(e.invars[0].aval.dtype == jnp.float32 for e in dots)


class NnxScaled(nnx.Module):
    def __init__(self, rngs):
        self.dense = nnx.Linear(4, 3, rngs=rngs)
        self.scale = 1.0  # a static attribute: part of the graphdef

    def __call__(self, x):
        TRACES.append(1)
        return self.dense(x) * self.scale


def test_trace_cache_nnx_misses_on_a_changed_attribute():
    policied = with_policy(NnxScaled(nnx.Rngs(0)), BF16_MIXED)
    x = _x()

    def out(model):
        graphdef, state = nnx.split(model)
        return jax.jit(lambda s: nnx.merge(graphdef, s)(x))(state)

    TRACES.clear()
    a = out(policied)
    b = out(policied)
    assert len(TRACES) == 1
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    policied.scale = 2.0
    c = out(policied)
    assert len(TRACES) == 2
    # The new attribute is the traced one (scaling by two is exact in bf16 and f32).
    np.testing.assert_array_equal(np.asarray(c), 2 * np.asarray(a))


def test_trace_cache_function_and_off_switch():
    counter: list = []

    def apply(params, x):
        counter.append(1)
        return jnp.tanh(x @ params["w"])

    params = {"w": jnp.full((4, 3), 0.25, jnp.float32)}
    x = _x()
    policied = with_policy(apply, BF16_MIXED)
    grads = [jax.jit(jax.grad(lambda p: jnp.sum(policied(p, x))))(params) for _ in range(2)]
    assert len(counter) == 1
    off = with_policy(apply, BF16_MIXED, cache_traces=False)
    ref = [jax.jit(jax.grad(lambda p: jnp.sum(off(p, x))))(params) for _ in range(2)]
    assert len(counter) == 3
    for g in (*grads, ref[1]):
        np.testing.assert_array_equal(np.asarray(g["w"]), np.asarray(ref[0]["w"]))
    with pytest.raises(TypeError, match="cache_traces must be a bool"):
        with_policy(apply, BF16_MIXED, cache_traces="yes")


def test_trace_cache_skips_a_trace_that_closes_over_a_tracer():
    """A model reading a value traced by an enclosing jit (here through a global) has that
    tracer among its jaxpr's constants: kept, it would leak into the next trace."""
    counter: list = []
    outer: dict = {}

    def apply(params, x):
        counter.append(1)
        return (x @ params["w"]) * outer["y"]

    policied = with_policy(apply, BF16_MIXED)
    params = {"w": jnp.full((4, 3), 0.25, jnp.float32)}
    x = _x()

    def step(p, y):
        outer["y"] = y
        return policied(p, x)

    # A new function per jit (jit keeps traces per function object): traced twice.
    a = jax.jit(lambda p, y: step(p, y))(params, jnp.float32(1.0))
    b = jax.jit(lambda p, y: step(p, y))(params, jnp.float32(2.0))
    assert len(counter) == 2
    np.testing.assert_array_equal(np.asarray(b), 2 * np.asarray(a))
