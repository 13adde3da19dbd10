"""Non-finite in, non-finite out: every recipe, every GEMM (the kernel backend's too), so loss
scaling sees the overflow.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fp8_testlib import DN, data, fwd_bwd

from fmtkit import fp8, scaling


def _overflow_step(name):
    """A jitted step of ``sum(dot(x, w) * c)`` under ``dynamic_loss_scale(sgd)``, x and w the
    parameters, ``c`` the cotangent of the dot's output (an inf there is an fp16 overflow in
    the backward pass). Delayed recipes run with a recorded history (amax 2 for each row),
    so their scales come from the history, not from the injected tensor."""
    import optax

    from fmtkit.optim import dynamic_loss_scale, loss_scale, scale_loss

    recipe = fp8.get_recipe(name)
    dg = fp8.dot_general_fn(recipe)
    opt = dynamic_loss_scale(optax.sgd(0.1), init_scale=2.0**4)
    state = None
    if recipe.delayed:
        state = fp8.init_state(recipe)
        state = state._replace(amax_history=state.amax_history.at[:, 0].set(2.0))

    @jax.jit
    def step(params, opt_state, c, fp8_state):
        def loss(p, s):
            kw = {} if s is None else {"fp8_state": s}
            y = dg(p["x"], p["w"], DN, **kw)
            return scale_loss(jnp.sum(y * c), opt_state), y

        (grads, observed), y = jax.grad(loss, argnums=(0, 1), has_aux=True)(params, fp8_state)
        updates, new_opt = opt.update(grads, opt_state, params)
        new_state = None if fp8_state is None else fp8.update_state(fp8_state, observed)
        return (y, grads, optax.apply_updates(params, updates), new_opt, new_state,
                loss_scale(new_opt))

    return opt, state, step


@pytest.mark.parametrize("name", list(fp8.RECIPES))
def test_inf_in_any_operand_or_cotangent_skips_the_step_and_backs_off_once(name):
    x = jax.random.normal(jax.random.key(0), (8, 48), jnp.float32)
    w = jax.random.normal(jax.random.key(1), (48, 24), jnp.float32) / 8
    c = jnp.ones((8, 24), jnp.float32)
    opt, fp8_state, step = _overflow_step(name)
    params = {"x": x, "w": w}
    opt_state = opt.init(params)
    finite = lambda a: bool(np.all(np.isfinite(np.asarray(a))))  # noqa: E731

    # control: a clean step is taken at the same scale
    y, grads, new_params, _, new_state, scale = step(params, opt_state, c, fp8_state)
    assert finite(y) and finite(grads["x"]) and finite(grads["w"])
    assert float(scale) == 16.0 and not np.array_equal(new_params["w"], w)

    # (injected tensor, the GEMM outputs that must then be non-finite)
    cases = {
        "x": (x.at[3, 5].set(jnp.inf), c, ("y", "dw")),  # forward and wgrad read x
        "w": (x, c, ("y", "dx")),  # forward and dgrad read w
        "cotangent": (x, c.at[2, 7].set(jnp.inf), ("dx", "dw")),  # dgrad and wgrad read dy
    }
    for where, (xi, ci, bad) in cases.items():
        wi = w.at[4, 6].set(-jnp.inf) if where == "w" else w
        p = {"x": xi, "w": wi}
        y, grads, new_params, _, new_state, scale = step(p, opt.init(p), ci, fp8_state)
        outs = {"y": y, "dx": grads["x"], "dw": grads["w"]}
        for gemm in bad:
            assert not finite(outs[gemm]), f"{name}: inf in {where} gives a finite {gemm}"
        # the step is skipped (parameters unchanged) and the scale backs off exactly once
        for k in p:
            np.testing.assert_array_equal(np.asarray(new_params[k]), np.asarray(p[k]))
        assert float(scale) == 8.0, (name, where, float(scale))
        if fp8_state is not None:  # the history skips the non-finite observation
            np.testing.assert_array_equal(np.asarray(new_state.amax_history),
                                          np.asarray(fp8_state.amax_history))


def test_delayed_inf_check_has_a_negative_control(set_fp8_switch):
    """Without ``keep_nonfinite`` the delayed recipe clips an inf to E4M3's max with the
    history's scale: the output is finite, which the test above would catch."""
    set_fp8_switch("keep_nonfinite", lambda x, v: v, obj=scaling)
    dg = fp8.dot_general_fn("delayed")
    state = fp8.init_state("delayed")
    state = state._replace(amax_history=state.amax_history.at[:, 0].set(2.0))
    x = jnp.ones((4, 16)).at[0, 0].set(jnp.inf)
    y = dg(x, jnp.ones((16, 4)), DN, fp8_state=state)
    assert np.all(np.isfinite(np.asarray(y)))


def test_unscaled_tile_keeps_inf():
    """A "none" tile (a plain saturating cast) turns inf into NaN, not into the format max."""
    recipe = fp8.Fp8Recipe(grad_tile="none", x_tile="none", w_tile="none")
    y = fp8.dot_general_fn(recipe)(jnp.ones((4, 16)).at[1, 2].set(jnp.inf), jnp.ones((16, 4)), DN)
    assert np.isnan(np.asarray(y)[1]).all() and np.isfinite(np.asarray(y)[0]).all()


def test_inf_reaches_every_gemm_through_the_pallas_kernel():
    """The kernel backends (GPU-interpret mode on CPU) keep the rule too: an inf in x, w or
    the cotangent makes the GEMMs that read it non-finite."""
    import pallas_kernels  # noqa: F401  (importing it registers the kernel backend)

    recipe = dataclasses.replace(fp8.RECIPES["blockwise"], use_kernel="interpret")
    x, w, dy = data(128, 128, 128)
    run = jax.jit(lambda a, b, g: fwd_bwd(recipe, a, b, g))
    finite = [np.all(np.isfinite(np.asarray(t))) for t in run(x, w, dy)]
    assert finite == [True, True, True]
    cases = {"x": ((x.at[3, 5].set(jnp.inf), w, dy), (False, True, False)),  # y, dx, dw
             "w": ((x, w.at[3, 5].set(jnp.inf), dy), (False, False, True)),
             "cotangent": ((x, w, dy.at[3, 5].set(jnp.inf)), (True, False, False))}
    for where, (args, expected) in cases.items():
        got = tuple(bool(np.all(np.isfinite(np.asarray(t)))) for t in run(*args))
        assert got == expected, where
