"""Precision policies on models written the way the field writes them.

Every check reads the jaxpr of the training step (``zoo.trace``: ``value_and_grad`` of the
training loss, written as ``jax.vjp`` with the cotangent seed as an input so that the backward
pass can be told apart), never ``inspect_policy``'s own report. Matmuls get a role from data
flow (``jaxpr_utils.matmul_role``): a forward / data-gradient / weight-gradient projection
(a parameter operand), attention (activation x activation), or the head (the vocabulary /
class dimension in an operand; each zoo model's head size occurs nowhere else).

The checkers are tested first, on hand-made jaxprs and on the unwrapped zoo (where the roles
must match counts made by hand), so a checker that cannot fail is caught.
"""

from __future__ import annotations

import collections
import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import zoo
from flax import nnx
from jaxpr_utils import (
    COTANGENT,
    DATA,
    PARAM,
    Matmul,
    compute_fraction,
    iter_eqns,
    label_eqns,
    low_precision_reductions,
    matmul_flops,
    matmuls,
    non_f32_transcendentals,
)

from fmtkit import fp8 as fp8_lib
from fmtkit.policy import inspect_policy, with_policy

CASES = list(zoo.CASES)
MIXED = {"bf16-mixed": "bfloat16", "fp16-mixed": "float16"}
FP8_PRESETS = ("fp8-current", "fp8-delayed", "fp8-rowwise", "fp8-blockwise", "fp8-mxfp8")
# Recipes whose blocks (128 / 32 elements) a zoo dimension may not fill: such a GEMM may run in
# the compute dtype with a warning instead of zero-padding it.
BLOCKED = ("fp8-blockwise", "fp8-mxfp8")
ALL_PRESETS = ("fp32", "bf16-mixed", "fp16-mixed", "pure-bf16", *FP8_PRESETS)
# The target: at least 95% of the matmul FLOPs outside the head on the compute dtype.
MIN_COMPUTE_FRACTION = 0.95


def _wrap(case, preset):
    return with_policy(case.build(), preset)


def _trace(case, model, *, warmup=False):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        traced = zoo.trace(case, model, warmup=warmup)
    return traced, [str(w.message) for w in caught]


@functools.cache
def _cached_trace(name, preset=None):
    """The traced training step of a zoo case, unwrapped (``preset=None``) or under a preset,
    shared by every test that reads it (built and traced once per worker)."""
    case = zoo.CASES[name]
    model = case.build() if preset is None else _wrap(case, preset)
    return _trace(case, model, warmup=preset == "fp8-delayed")


def _roles(found):
    return collections.Counter(m.role for m in found)


# ---------------------------------------------------------------------------------------------
# The checkers, on hand-made jaxprs


def _labelled_step(loss, params, data):
    """Records and grad-output labels of vjp(loss) with an explicit cotangent seed."""
    def step(params, data, ct):
        value, pullback = jax.vjp(lambda p: loss(p, data), params)
        return value, pullback(ct)[0]

    closed = jax.make_jaxpr(step)(params, data, jnp.float32(1))
    labels = ([{PARAM}] * len(jax.tree.leaves(params)) + [{DATA}] * len(jax.tree.leaves(data))
              + [{COTANGENT}])
    records, outs = label_eqns(closed, labels)
    return records, outs[1:]


def test_roles_of_a_two_layer_mlp():
    params = {"w1": jnp.ones((5, 6)), "w2": jnp.ones((6, 3))}

    def loss(p, x):
        return jnp.sum(jnp.tanh(x @ p["w1"]) @ p["w2"])

    records, outs = _labelled_step(loss, params, jnp.ones((4, 5)))
    found = matmuls(records, outs, head_size=3)
    # x @ w1 forward and its weight gradient (no data gradient: x is not differentiated); the
    # head's forward, data gradient and weight gradient.
    assert _roles(found) == {"fwd": 1, "wgrad": 1, "head": 3}
    wgrad = next(m for m in found if m.role == "wgrad")
    assert wgrad.flops == 2 * 5 * 6 * 4
    # With the head size changed, the same dots are seen as projections.
    assert _roles(matmuls(records, outs, head_size=97)) == {"fwd": 2, "dgrad": 1, "wgrad": 2}


def test_roles_of_attention():
    params = {"wq": jnp.ones((8, 8)), "wk": jnp.ones((8, 8)), "wo": jnp.ones((8, 5))}

    def loss(p, x):  # x [B, T, D]; scores are batched over B
        q, k = x @ p["wq"], x @ p["wk"]
        s = jax.nn.softmax(jnp.einsum("btd,bsd->bts", q, k), axis=-1)
        return jnp.sum(jnp.einsum("bts,bsd->btd", s, q) @ p["wo"])

    records, outs = _labelled_step(loss, params, jnp.ones((2, 3, 8)))
    roles = _roles(matmuls(records, outs, head_size=5))
    # QK^T forward; its backward w.r.t. q and k (2); PV forward and its 2 backward dots.
    assert roles["act_fwd"] == 2 and roles["act_bwd"] == 4
    # wq, wk: forward and weight gradient; no data gradient (x is data, not differentiated).
    assert roles["fwd"] == 2 and roles["wgrad"] == 2 and roles["head"] == 3
    assert roles["dgrad"] == 0


def test_roles_inside_scan_and_cond():
    params = {"ws": jnp.ones((3, 4, 4)) * 0.1, "wc": jnp.ones((4, 4))}

    def loss(p, x):
        def body(c, w):
            return jnp.tanh(c @ w), None

        c, _ = jax.lax.scan(body, x, p["ws"])
        c = jax.lax.cond(jnp.sum(x) > 0, lambda c: c @ p["wc"], lambda c: c * 2.0, c)
        return jnp.sum(c)

    records, outs = _labelled_step(loss, params, jnp.ones((2, 4)))
    roles = _roles(matmuls(records, outs, head_size=97))
    # Scan body: forward, data gradient (through the carry) and weight gradient; cond: the
    # same three (the transpose of a cond is a cond).
    assert roles == {"fwd": 2, "dgrad": 2, "wgrad": 2}, roles


def test_a_matmul_not_reaching_a_weight_gradient_is_not_wgrad():
    # The cotangent x activation product feeds another matmul before reaching w's gradient:
    # it is an activation gradient (act_bwd), only the last one is the weight gradient.
    params = {"w": jnp.ones((4, 4))}

    def loss(p, x):
        h = x @ p["w"]
        return jnp.sum(jnp.einsum("bij,bjk->bik", h, h))

    records, outs = _labelled_step(loss, params, jnp.ones((2, 4, 4)))
    roles = _roles(matmuls(records, outs, head_size=97))
    assert roles["wgrad"] == 1 and roles["act_bwd"] == 2 and roles["act_fwd"] == 1


@jax.custom_vjp
def _amax_scaled_matmul(x, w):
    return x @ w


def _amax_scaled_fwd(x, w):
    return x @ w, (x, w)


def _amax_scaled_bwd(res, g):
    # As an FP8 recipe does: the gradient is scaled by its amax, the products rescaled.
    x, w = res
    s = jnp.max(jnp.abs(g))
    return ((g / s) @ w.T) * s, jnp.einsum("bti,btj->ij", x, g / s) * s


_amax_scaled_matmul.defvjp(_amax_scaled_fwd, _amax_scaled_bwd)


def test_an_amax_scale_does_not_make_a_weight_gradient():
    # The attention-like backward dots feed the weight gradient's *scale* (an amax), not its
    # value: they stay activation gradients.
    params = {"w": jnp.ones((4, 4))}

    def loss(p, x):
        h = _amax_scaled_matmul(x, p["w"])
        return jnp.sum(jnp.einsum("bij,bjk->bik", h, h))

    records, outs = _labelled_step(loss, params, jnp.ones((2, 4, 4)))
    roles = _roles(matmuls(records, outs, head_size=97))
    assert roles["wgrad"] == 1 and roles["act_bwd"] == 2, roles


def test_matmul_flops_by_hand():
    dot = jax.make_jaxpr(lambda a, b: jnp.einsum("bij,bjk->bik", a, b))(
        jnp.ones((2, 4, 5)), jnp.ones((2, 5, 6))).jaxpr.eqns[0]
    assert matmul_flops(dot) == 2 * 2 * 4 * 6 * 5
    conv = jax.make_jaxpr(lambda x, k: jax.lax.conv_general_dilated(
        x, k, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")))(
            jnp.ones((1, 6, 6, 2)), jnp.ones((3, 3, 2, 4))).jaxpr.eqns[0]
    assert matmul_flops(conv) == 2 * (6 * 6 * 4) * (3 * 3 * 2)


def test_transcendental_and_reduction_checkers():
    bf16, f16 = jnp.bfloat16, jnp.float16
    x = jnp.ones((4, 3))
    low = jax.make_jaxpr(lambda x: (jnp.exp(x.astype(bf16)), jnp.log1p(x.astype(f16)),
                                    jax.lax.rsqrt(x.astype(bf16)), jnp.log(x)))(x)
    assert sorted(non_f32_transcendentals(low)) == [
        "exp -> bfloat16", "log1p -> float16", "rsqrt -> bfloat16"]
    ok = jax.make_jaxpr(lambda x: jnp.exp(x.astype(bf16).astype(jnp.float32)))(x)
    assert non_f32_transcendentals(ok) == []
    red = jax.make_jaxpr(lambda x: (jax.lax.reduce_max(x.astype(bf16), (1,)),
                                    jnp.cumsum(x.astype(f16), axis=0),
                                    jnp.sum(x, axis=1), jnp.sum(x.astype(jnp.int32))))(x)
    assert sorted(low_precision_reductions(red)) == [
        "cumsum of float16(4, 3)", "reduce_max of bfloat16(4, 3)"]


def test_compute_fraction_and_fp8_flag():
    mk = Matmul
    bf, f32 = ("bfloat16", "bfloat16"), ("float32", "float32")
    found = [mk("fwd", bf, 95, ""), mk("act_fwd", f32, 5, ""), mk("head", f32, 1000, ""),
             mk("wgrad", ("bfloat16", "float32"), 10, ""), mk("dgrad", bf, 30, "")]
    assert compute_fraction(found, jnp.bfloat16, backward=False) == pytest.approx(0.95)
    assert compute_fraction(found, jnp.bfloat16, backward=True) == pytest.approx(0.75)
    assert compute_fraction(found, jnp.float16, backward=False) == 0
    assert mk("fwd", ("float8_e4m3fn", "float8_e5m2"), 1, "").fp8
    assert not mk("fwd", ("float8_e4m3fn", "bfloat16"), 1, "").fp8
    assert not mk("fwd", ("int8", "int8"), 1, "").fp8


# ---------------------------------------------------------------------------------------------
# The checkers read the unwrapped zoo's roles right (that every zoo model trains is shown by the
# preset tests below: "fp32" equals the unwrapped model exactly and trains)


@pytest.mark.slow
@pytest.mark.parametrize("name", CASES)
def test_checker_finds_every_role_in_the_unwrapped_zoo(name):
    case = zoo.CASES[name]
    traced, _ = _cached_trace(name)
    found = traced.matmuls(case.head_size)
    roles = _roles(found)
    assert roles["fwd"] == case.n_projections and roles["wgrad"] == case.n_projections
    assert roles["act_fwd"] == case.n_attention and roles["act_bwd"] == 2 * case.n_attention
    assert roles["head"] == 3 and roles["dgrad"] >= 1
    assert all(m.dtypes == ("float32", "float32") for m in found)
    assert non_f32_transcendentals(traced.train) == []
    assert low_precision_reductions(traced.forward) == []
    assert traced.logits.dtype == jnp.float32


# ---------------------------------------------------------------------------------------------
# Mixed presets: f32 where precision matters, the compute dtype for >= 95% of matmul FLOPs


@pytest.mark.slow
@pytest.mark.parametrize("preset", MIXED)
@pytest.mark.parametrize("name", CASES)
def test_mixed_preset_op_level_dtypes(name, preset):
    case = zoo.CASES[name]
    traced, _ = _cached_trace(name, preset)
    assert non_f32_transcendentals(traced.train) == []
    assert low_precision_reductions(traced.forward) == []
    found = traced.matmuls(case.head_size)
    for backward in (False, True):
        frac = compute_fraction(found, MIXED[preset], backward=backward)
        assert frac >= MIN_COMPUTE_FRACTION, (backward, frac, [
            (m.role, m.dtypes, m.where) for m in found if m.role != "head"])
    assert _roles(found)["head"] >= 3
    assert traced.logits.dtype == jnp.float32


@pytest.mark.slow
def test_explicit_f32_upcast_before_the_tied_head_stays():
    # wmt with bf16 layers (use_bfloat16) writes ``attend(y.astype(jnp.float32))``: the
    # author's upcast is kept, so the tied head's forward matmul runs on f32 operands (the
    # policy must not cast it back to bf16). Flax's bf16 LayerNorm needs standard promotion.
    case = zoo.dataclasses.replace(zoo.CASES["linen_wmt"],
                                   build=lambda: zoo.WmtTransformer(dtype=jnp.bfloat16))
    heads = []
    with jax.numpy_dtype_promotion("standard"):
        for model in (case.build(), _wrap(case, "bf16-mixed")):
            traced, _ = _trace(case, model)
            heads.append([m.dtypes for m in traced.matmuls(case.head_size)
                          if m.role == "head" and not m.backward])
    assert heads[0] == [("float32", "float32")]  # the model as written
    assert heads[1] == [("float32", "float32")]


@pytest.mark.slow
def test_nnx_policied_module_trains_the_original_variables():
    case = zoo.CASES["nnx_lm"]
    original = case.build()
    before = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(original, nnx.Param)))
    wrapped = with_policy(original, "bf16-mixed")
    losses = zoo.nnx_optimizer_train(case, wrapped, steps=2)
    after = nnx.to_pure_dict(nnx.state(original, nnx.Param))
    changed = [not np.array_equal(a, np.asarray(b)) for a, b in
               zip(jax.tree.leaves(before), jax.tree.leaves(after))]
    assert np.all(np.isfinite(losses)) and all(changed)
    assert all(np.asarray(x).dtype == np.float32 for x in jax.tree.leaves(after))


# ---------------------------------------------------------------------------------------------
# FP8 presets: projections in FP8 forward and backward, head and attention not


@pytest.mark.slow
@pytest.mark.parametrize("preset", FP8_PRESETS)
@pytest.mark.parametrize("name", CASES)
def test_fp8_preset_matmul_roles(name, preset):
    case = zoo.CASES[name]
    traced, caught = _cached_trace(name, preset)
    found = traced.matmuls(case.head_size)
    roles = _roles(found)
    assert roles["fwd"] >= case.n_projections and roles["wgrad"] >= case.n_projections
    assert roles["dgrad"] >= 1 and roles["head"] >= 3
    not_fp8 = [(m.role, m.dtypes, m.where) for m in found
               if m.role in ("fwd", "dgrad", "wgrad") and not m.fp8]
    if preset in BLOCKED and not_fp8:
        # Allowed: the GEMM runs in the compute dtype, with a warning.
        assert all(dts == ("bfloat16", "bfloat16") for _, dts, _ in not_fp8), not_fp8
        # (the CNNs' convolution warning does not count: it is about the convolutions)
        gemm_warnings = [w for w in caught if not w.startswith("Convolutions in module")]
        assert gemm_warnings, f"{preset}: GEMMs left out of FP8 without a warning: {not_fp8}"
    else:
        assert not_fp8 == []
    assert not [m for m in found if m.role == "head" and any(
        jnp.dtype(d).itemsize == 1 for d in m.dtypes)]
    attention = [m.dtypes for m in found if m.role in ("act_fwd", "act_bwd")]
    assert all(d == ("bfloat16", "bfloat16") for d in attention), attention
    assert traced.logits.dtype == jnp.float32


def _train_wrapped(case, preset, steps=5):
    model = _wrap(case, preset)
    update = fp8_lib.update_state if preset == "fp8-delayed" else None
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        if case.api == "nnx":
            losses = zoo.nnx_optimizer_train(case, model, steps=steps, update_fp8=update)
            return losses, model
        losses, diff = zoo.sgd_train(case, model, steps=steps, update_fp8=update)
    return losses, diff


@functools.cache
def _cached_losses(name, preset):
    """Losses of five training steps of a zoo case under a preset, shared by the tests that
    train the same pair (the FP8 pairs and the stacked-layer presets)."""
    return tuple(_train_wrapped(zoo.CASES[name], preset)[0])


# Training compiles and runs each model: every model trains under two FP8 presets and every
# preset under four models (the matmul-role test above traces every pair).
TRAIN_PAIRS = [(name, FP8_PRESETS[(i + shift) % len(FP8_PRESETS)])
               for shift in (0, 2) for i, name in enumerate(CASES)]


@pytest.mark.slow
@pytest.mark.parametrize(("name", "preset"), TRAIN_PAIRS)
def test_fp8_preset_trains_on_sizes_not_multiple_of_128(name, preset):
    losses = _cached_losses(name, preset)
    assert np.all(np.isfinite(losses)) and losses[-1] < 0.9 * losses[0], losses


def _gemma_128():
    # Every projection dimension and batch x sequence (2 x 64) a multiple of 128: no
    # padding and no fallback is needed, so every projection GEMM must be FP8.
    tokens = zoo._tokens(2, 64, 97)
    return zoo.Case("gemma128", "linen", lambda: zoo.GemmaLm(
        embed_dim=128, num_heads=4, num_kv_heads=2, head_dim=32, hidden_dim=256, num_layers=1),
        (tokens,), tokens, 97, n_projections=6, n_attention=2)


@pytest.mark.slow
@pytest.mark.parametrize("preset", BLOCKED)
def test_blocked_fp8_presets_are_fp8_on_multiples_of_128(preset):
    case = _gemma_128()
    traced, caught = _trace(case, _wrap(case, preset))
    found = traced.matmuls(case.head_size)
    proj = [m for m in found if m.role in ("fwd", "dgrad", "wgrad")]
    assert len(proj) >= 3 * case.n_projections - 3  # the first projections' dgrads may merge
    assert all(m.fp8 for m in proj), [(m.role, m.dtypes, m.where) for m in proj if not m.fp8]
    assert caught == []


# ---------------------------------------------------------------------------------------------
# "fp32": exactly the unwrapped model; one trace for three steps


def _counted_sgd_step(loss_fn, traces):
    """A jitted SGD step that also returns the loss and the parameter gradients, and records
    each trace in ``traces``."""
    @jax.jit
    def step(diff, aux, data):
        traces.append(1)
        (loss, aux), g = jax.value_and_grad(loss_fn, has_aux=True)(diff, aux, data)
        params = jax.tree.map(lambda p, g: p - 0.01 * g, diff["params"], g["params"])
        return {**diff, "params": params}, aux, loss, g["params"]

    return step


@pytest.mark.slow
@pytest.mark.parametrize("name", CASES)
def test_fp32_preset_equals_unwrapped_exactly_and_traces_once(name):
    # One compiled step per model: its first call gives the loss and gradients compared with
    # the unwrapped model's, bit for bit; three calls with evolving state trace it once.
    case = zoo.CASES[name]
    plain = case.build()
    wrapped = with_policy(plain, "fp32")
    fwd_p, diff, aux = zoo.functional(case, plain)
    fwd_w, diff_w, aux_w = zoo.functional(case, wrapped)
    if case.api == "nnx":
        # The policied module holds the original (its state may nest under an attribute)
        # and shares its Variables: each is differentiated with respect to its own state.
        inputs = ((fwd_p, diff, aux), (fwd_w, diff_w, aux_w))
    else:  # the same variables go into both
        assert jax.tree.structure(diff_w) == jax.tree.structure(diff)
        assert jax.tree.structure(aux_w) == jax.tree.structure(aux)
        inputs = ((fwd_p, diff, aux), (fwd_w, diff, aux))
    results, traces, losses = [], [], []
    for fwd, d, a in inputs:
        traces.clear()
        step = _counted_sgd_step(zoo.training_loss(fwd), traces)
        d, a, loss, grads = step(d, a, zoo.batch(case))
        results.append(jax.tree.leaves((loss, grads)))
    for i in (1, 2):  # the wrapped step, again, with the state it returned
        d, a, loss, _ = step(d, a, zoo.batch(case, i))
        losses.append(float(loss))
    assert len(results[0]) == len(results[1])
    for a, b in zip(*results):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert len(traces) == 1 and np.all(np.isfinite(losses))


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n, c in zoo.CASES.items() if c.api == "nnx"])
def test_fp32_nnx_optimizer_step_traces_once(name):
    # The users' NNX step (nnx.jit, nnx.value_and_grad, nnx.Optimizer), counted.
    import optax

    case = zoo.CASES[name]
    wrapped = with_policy(case.build(), "fp32")
    traces = []
    opt = nnx.Optimizer(wrapped, optax.sgd(0.01), wrt=nnx.Param)

    @nnx.jit
    def nnx_step(model, opt, data):
        traces.append(1)

        def loss(m):
            kw = {"rngs": nnx.Rngs(dropout=data["key"])} if case.call_rngs else {}
            return zoo.xent(m(*data["inputs"], **kw), data["labels"])

        value, grads = nnx.value_and_grad(loss)(model)
        opt.update(model, grads)
        return value

    losses = [float(nnx_step(wrapped, opt, zoo.batch(case, i))) for i in range(3)]
    assert len(traces) == 1 and np.all(np.isfinite(losses))


# ---------------------------------------------------------------------------------------------
# Stacked layers: nn.scan and nnx.vmap + nnx.scan under every preset; one history per layer


@pytest.mark.slow
@pytest.mark.parametrize("preset", ALL_PRESETS)
@pytest.mark.parametrize("name", ["linen_scan", "nnx_scan"])
def test_stacked_layers_train_under_every_preset(name, preset):
    case = zoo.CASES[name]
    if case.api == "linen" and preset == "fp8-delayed":
        # The histories are per layer: the stack carries them along its layer axis.
        case = zoo.dataclasses.replace(case, build=lambda: zoo.ScanLm(
            variable_axes=(("params", 0), ("fp8_state", 0))))
        losses, _ = _train_wrapped(case, preset)
    else:
        losses = _cached_losses(name, preset)
    assert np.all(np.isfinite(losses)) and losses[-1] < 0.9 * losses[0], losses


def _fp8_state_size(tree) -> int:
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tree))


@pytest.mark.slow
def test_linen_scan_has_one_delayed_history_per_layer():
    case = zoo.CASES["linen_scan"]
    unrolled = zoo.dataclasses.replace(case, build=zoo.UnrolledLm)
    _, diff_unrolled, _ = zoo.functional(unrolled, _wrap(unrolled, "fp8-delayed"))
    per_layer_total = _fp8_state_size(diff_unrolled["fp8_state"])
    assert per_layer_total > 0
    fixed = zoo.dataclasses.replace(case, build=lambda: zoo.ScanLm(
        variable_axes=(("params", 0), ("fp8_state", 0))))
    _, diff, _ = zoo.functional(fixed, _wrap(fixed, "fp8-delayed"))
    assert _fp8_state_size(diff["fp8_state"]) == per_layer_total
    # As users write it ({"params": 0} only): per-layer histories, or an error naming the fix.
    try:
        _, diff, _ = zoo.functional(case, _wrap(case, "fp8-delayed"))
    except Exception as err:  # the message is what is checked
        assert "variable_axes" in str(err) and "fp8_state" in str(err), err
    else:
        assert _fp8_state_size(diff["fp8_state"]) == per_layer_total


class NnxUnrolledMlp(nnx.Module):
    """``zoo.NnxScanMlp`` with its blocks in an ``nnx.List`` (one module per layer)."""

    def __init__(self, in_dim=24, dim=40, n_layers=3, num_classes=7, *, rngs):
        self.embed_in = nnx.Linear(in_dim, dim, rngs=rngs)
        self.layers = nnx.List([zoo.NnxScanBlock(dim, rngs=rngs) for _ in range(n_layers)])
        self.logitdense = nnx.Linear(dim, num_classes, rngs=rngs)

    def __call__(self, x):
        x = self.embed_in(x)
        for layer in self.layers:
            x = layer(x)
        return self.logitdense(x)


@pytest.mark.slow
def test_nnx_scan_has_one_delayed_history_per_layer():
    case = zoo.CASES["nnx_scan"]
    fp8_type = zoo.fp8_state_type()
    stacked = _wrap(case, "fp8-delayed")
    unrolled = with_policy(NnxUnrolledMlp(rngs=nnx.Rngs(0)), "fp8-delayed")
    # The delayed state may be created lazily, at the first call.
    for model in (stacked, unrolled):
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("always")
            model(*case.inputs)
    size = _fp8_state_size(nnx.state(unrolled, fp8_type)) if fp8_type else 0
    assert size > 0
    assert _fp8_state_size(nnx.state(stacked, fp8_type)) == size
    losses = _cached_losses("nnx_scan", "fp8-delayed")
    assert losses[-1] < 0.9 * losses[0]


# ---------------------------------------------------------------------------------------------
# Bad input


@pytest.mark.parametrize("name", ["linen_lm1b", "nnx_lm", "jax_mlp"])
@pytest.mark.parametrize("dtype", ["bf16", "bfloat16", "float16", "fp16", "f32", "float32"])
def test_bare_dtype_string_is_rejected_with_a_suggestion(name, dtype):
    case = zoo.CASES[name]
    with pytest.raises(ValueError) as err:
        with_policy(case.build(), dtype)
    assert "bf16-mixed" in str(err.value) or 'Policy.parse("p=' in str(err.value), err.value


# ---------------------------------------------------------------------------------------------
# inspect_policy: runs where it failed before (NNX training mode, nnx.Rngs arguments,
# nnx.scan stacks with BatchNorm, linen fp8-delayed with default arguments), and its report
# agrees with the jaxpr read here


def _pairs(dots) -> set[tuple[str, str]]:
    """``"lhs x rhs -> out"`` strings -> {(lhs, rhs)}."""
    return {tuple(d.split(" -> ")[0].split(" x ")) for d in dots}


def _report_pairs(report, kind="forward", *, head=False) -> set[tuple[str, str]]:
    return _pairs(d for _, d in report.matmuls(kind, head=head))


def _my_pairs(found, roles) -> set[tuple[str, str]]:
    return {m.dtypes for m in found if m.role in roles}


def _check_report_agrees(report, traced, case):
    """The report's forward matmul and head operand dtypes, and its rsqrt result dtypes, are
    those read from the training step's jaxpr here."""
    found = traced.matmuls(case.head_size)
    assert _report_pairs(report) == _my_pairs(found, ("fwd", "act_fwd", "conv_fwd"))
    mine_head = {m.dtypes for m in found if m.role == "head" and not m.backward}
    assert _report_pairs(report, head=True) == mine_head
    reported = set()
    for m in report.modules.values():
        reported |= set(m.ops.get("rsqrt", ()))
    mine = {str(e.outvars[0].aval.dtype) for e in iter_eqns(traced.forward)
            if e.primitive.name == "rsqrt"}
    assert mine and reported == mine, (reported, mine)


@pytest.mark.slow
def test_inspect_policy_nnx_cnn_training_mode_with_rngs_argument():
    case = zoo.CASES["nnx_cnn"]
    model = _wrap(case, "bf16-mixed")
    report = inspect_policy(model, *case.inputs, nnx.Rngs(dropout=1),
                            loss_fn=lambda logits: zoo.xent(logits, case.labels))
    traced, _ = _cached_trace("nnx_cnn", "bf16-mixed")
    _check_report_agrees(report, traced, case)
    assert report.modules["linear2"].head  # the classifier is the head, by role


@pytest.mark.slow
def test_inspect_policy_nnx_scan_stack_with_batchnorm():
    case = zoo.CASES["nnx_scan"]
    model = _wrap(case, "bf16-mixed")
    report = inspect_policy(model, *case.inputs,
                            loss_fn=lambda logits: zoo.xent(logits, case.labels))
    traced, _ = _cached_trace("nnx_scan", "bf16-mixed")
    _check_report_agrees(report, traced, case)


@pytest.mark.slow
def test_inspect_policy_linen_fp8_delayed_default_arguments():
    case = zoo.CASES["linen_lm1b"]
    model = _wrap(case, "fp8-delayed")
    report = inspect_policy(model, *case.inputs)  # variables, loss: defaults
    traced, _ = _cached_trace("linen_lm1b", "fp8-delayed")
    found = traced.matmuls(case.head_size)
    fp8_fwd = _my_pairs(found, ("fwd",))
    assert fp8_fwd and all(jnp.dtype(d).itemsize == 1 for pair in fp8_fwd for d in pair)
    assert _report_pairs(report) == _my_pairs(found, ("fwd", "act_fwd"))
    assert _report_pairs(report, "wgrad") == _my_pairs(found, ("wgrad",))
    head_fwd = {m.dtypes for m in found if m.role == "head" and not m.backward}
    assert _report_pairs(report, head=True) == head_fwd
    assert not any(jnp.dtype(d).itemsize == 1 for pair in head_fwd for d in pair)
