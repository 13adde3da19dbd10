"""``intercept_gemms`` (and ``fmtkit.debug.capture``, built on it) sees every GEMM of a
function traced inside its block, even when ``jax.jit`` or ``jax.make_jaxpr`` traced the same
function object before (JAX's trace cache would hand back that earlier trace, without the
hook); and a trace made inside a block is not reused outside it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fmtkit.debug as debug
from fmtkit.policy import intercept_gemms, with_policy

RNG = np.random.default_rng(3)
W = jnp.asarray(RNG.standard_normal((8, 8)), jnp.float32) / 4
X = jnp.asarray(RNG.standard_normal((4, 8)), jnp.float32)


def _policied():
    return with_policy(lambda w, x: jnp.tanh(x @ w) @ w.T, "bf16-mixed")


def _seen(fn, trace):
    seen = []

    def hook(site, run, lhs, rhs):
        seen.append(site.name)
        return run(lhs, rhs, site.fp8)

    with intercept_gemms(hook):
        trace(fn)(W, X)
    return seen


@pytest.mark.parametrize("before", [jax.jit, jax.make_jaxpr])
@pytest.mark.parametrize("inside", [jax.jit, jax.make_jaxpr])
def test_the_hook_sees_a_function_traced_before_the_block(before, inside):
    f = _policied()
    before(f)(W, X)  # traced (and cached by JAX) without a hook
    assert _seen(f, inside) == ["dot_general_0", "dot_general_1"]
    # a second block with the same function: the hook sees it again
    assert _seen(f, inside) == ["dot_general_0", "dot_general_1"]


def test_a_trace_made_inside_a_block_is_not_reused_outside_it():
    f = jax.jit(_policied())
    plain = np.asarray(f(W, X))

    def doubled(site, run, lhs, rhs):
        return 2 * run(lhs, rhs, site.fp8)

    with intercept_gemms(doubled):
        inside = np.asarray(f(W, X))
    assert not np.array_equal(inside, plain)
    np.testing.assert_array_equal(np.asarray(f(W, X)), plain)


def test_capture_logs_a_jitted_model_that_ran_before():
    fwd = jax.jit(_policied())
    fwd(W, X)  # an eval step, say, before the first logged step

    def loss(w):
        return jnp.sum(fwd(w, X).astype(jnp.float32))

    cfg = debug.DebugConfig([debug.Rule("", tensors=("activation",), stats=("amax",))])
    state = debug.init(cfg, loss, W)
    assert set(state[""]) == {"dot_general_0", "dot_general_1"}

    def step(w, s):
        with debug.capture(cfg, s, 0):
            return loss(w)

    stats = jax.grad(step, argnums=1)(W, state)
    # the first GEMM's activation is x (bf16 under bf16-mixed): its amax, exactly
    want = float(jnp.abs(X.astype(jnp.bfloat16)).max())
    assert float(stats[""]["dot_general_0"]["activation"]["amax"]) == want
