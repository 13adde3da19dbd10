"""fmtkit.qwix.FmtkitProvider: under qwix.quantize_model, matched GEMMs are fmtkit.fp8's,
bit for bit, with FP8 operands in all three GEMMs; everything else stays as written."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

qwix = pytest.importorskip("qwix")

from fp8_provenance import fp8_operands  # noqa: E402
from jaxpr_utils import COTANGENT, DATA, PARAM, label_eqns, matmul_role  # noqa: E402

from fmtkit import fp8  # noqa: E402
from fmtkit.qwix import FmtkitProvider, FmtkitRule  # noqa: E402

RECIPES = ["current", "rowwise", "blockwise", "mxfp8"]
X = jax.random.normal(jax.random.key(1), (64, 128), jnp.float32)


class Mlp(nn.Module):
    """up and down are the matched layers, head the unmatched one (distinct shapes, so
    qwix's parameter lookup never confuses an activation with a kernel)."""

    dg: object = None
    head_dg: object = None
    precision: object = None

    @nn.compact
    def __call__(self, x):
        kw = {} if self.dg is None else {"dot_general": self.dg}
        h = nn.Dense(256, name="up", precision=self.precision, **kw)(x)
        h = nn.Dense(96, name="down", precision=self.precision, **kw)(jax.nn.gelu(h))
        hkw = {} if self.head_dg is None else {"dot_general": self.head_dg}
        return nn.Dense(10, name="head", **hkw)(h)


def _rules(recipe, path="(up|down)"):
    return FmtkitProvider([FmtkitRule(module_path=path, recipe=recipe)])


def _linen_vg(model, params):
    def loss(p):
        return jnp.mean(jnp.square(model.apply(p, X)))
    return jax.jit(jax.value_and_grad(loss))(params)


def _equal(a, b) -> bool:
    return all(np.array_equal(np.asarray(u), np.asarray(v)) for u, v in
               zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


@pytest.mark.slow
@pytest.mark.parametrize("recipe", [*RECIPES, "nvfp4", "mxfp4"])
def test_linen_model_is_bit_identical_to_dense_with_fmtkit_dot_general(recipe):
    params = Mlp().init(jax.random.key(0), X)
    got = _linen_vg(qwix.quantize_model(Mlp(), _rules(recipe)), params)
    want = _linen_vg(Mlp(dg=fp8.dot_general_fn(recipe)), params)
    flt = _linen_vg(Mlp(), params)
    assert _equal(got, want)
    assert not _equal(got[0], flt[0])  # the recipe ran: the loss differs from float's


class NnxMlp(nnx.Module):
    def __init__(self, dg=None, *, rngs):
        kw = {} if dg is None else {"dot_general": dg}
        self.up = nnx.Linear(128, 256, rngs=rngs, **kw)
        self.down = nnx.Linear(256, 96, rngs=rngs, **kw)
        self.head = nnx.Linear(96, 10, rngs=rngs)

    def __call__(self, x):
        return self.head(self.down(jax.nn.gelu(self.up(x))))


def _nnx_vg(model):
    graph, state = nnx.split(model)

    def loss(s):
        return jnp.mean(jnp.square(nnx.merge(graph, s)(X)))
    return jax.jit(jax.value_and_grad(loss))(state)


@pytest.mark.slow
@pytest.mark.parametrize("recipe", RECIPES)
def test_nnx_model_is_bit_identical_to_linear_with_fmtkit_dot_general(recipe):
    got = _nnx_vg(qwix.quantize_model(NnxMlp(rngs=nnx.Rngs(0)), _rules(recipe), X))
    want = _nnx_vg(NnxMlp(fp8.dot_general_fn(recipe), rngs=nnx.Rngs(0)))
    flt = _nnx_vg(NnxMlp(rngs=nnx.Rngs(0)))
    assert _equal(got, want)
    assert not _equal(got[0], flt[0])


@pytest.mark.slow
@pytest.mark.parametrize("rules", [
    [FmtkitRule(module_path="nothing_here", recipe="blockwise")],
    # recipe=None exempts the modules it matches ahead of a broader rule.
    [FmtkitRule(module_path=".*"), FmtkitRule(module_path=".*", recipe="blockwise")],
    [FmtkitRule(module_path=".*", op_names=("einsum",), recipe="blockwise")],
], ids=["no-match", "exempted", "other-op"])
def test_unmatched_modules_are_bit_identical_to_the_float_model(rules):
    params = Mlp().init(jax.random.key(0), X)
    got = _linen_vg(qwix.quantize_model(Mlp(), FmtkitProvider(rules)), params)
    assert _equal(got, _linen_vg(Mlp(), params))


@pytest.mark.slow
def test_a_higher_precision_stays_as_written():
    hi = jax.lax.Precision.HIGHEST
    params = Mlp().init(jax.random.key(0), X)
    got = _linen_vg(qwix.quantize_model(Mlp(precision=hi), _rules("current")), params)
    assert _equal(got, _linen_vg(Mlp(precision=hi), params))


@pytest.mark.slow
def test_plain_qwix_rules_keep_working_in_the_same_provider():
    qt = qwix.QtRule(module_path="head", weight_qtype=jnp.float8_e4m3fn,
                     act_qtype=jnp.float8_e4m3fn)
    params = Mlp().init(jax.random.key(0), X)
    mixed = FmtkitProvider([FmtkitRule(module_path="(up|down)", recipe="current"), qt])
    got = _linen_vg(qwix.quantize_model(Mlp(), mixed), params)
    want = _linen_vg(qwix.quantize_model(Mlp(dg=fp8.dot_general_fn("current")),
                                         qwix.QtProvider([qt])), params)
    assert _equal(got, want)
    # The qwix rule did quantize the head: not the FP8 model with a float head.
    assert not _equal(got, _linen_vg(Mlp(dg=fp8.dot_general_fn("current")), params))


def test_delayed_scaling_is_refused_with_a_pointer_to_with_policy():
    with pytest.raises(ValueError, match="with_policy"):
        FmtkitRule(module_path=".*", recipe="delayed")
    with pytest.raises(ValueError, match="weight_qtype"):
        FmtkitRule(module_path=".*", recipe="current", weight_qtype=jnp.int8)
    with pytest.raises(ValueError, match="Unknown recipe"):
        FmtkitRule(module_path=".*", recipe="no-such-recipe")


class WeightLeft(nn.Module):
    """A projection written weight first (``einsum("nk,bk->bn", w, x)``), as MaxText writes
    some of its einsums (jnp.einsum itself may hand the weight to dot_general on either
    side; the swap of a weight given as lhs is tested with lax.dot_general below)."""

    @nn.compact
    def __call__(self, x):
        w = self.param("w", nn.initializers.lecun_normal(), (256, x.shape[-1]))
        return jnp.einsum("nk,bk->bn", w, x)


@pytest.mark.slow
def test_einsum_with_the_weight_on_the_left_gets_the_weight_tiling():
    params = WeightLeft().init(jax.random.key(0), X)
    model = qwix.quantize_model(WeightLeft(), _rules("blockwise", ".*"))
    w = params["params"]["w"]
    dg = fp8.dot_general_fn("blockwise")
    dn = (((1,), (1,)), ((), ()))

    def ref(p):  # x · wᵀ with w as fmtkit's weight operand (128x128 blocks)
        return jnp.mean(jnp.square(dg(X, p["params"]["w"], dn)))

    def swapped(p):  # w as the activation (1x128 tiles): what the swap must avoid
        return jnp.mean(jnp.square(dg(p["params"]["w"], X, dn).T))

    got = jax.jit(jax.value_and_grad(lambda p: jnp.mean(jnp.square(model.apply(p, X)))))(
        params)
    assert _equal(got, jax.jit(jax.value_and_grad(ref))(params))
    assert not _equal(got[0], jax.jit(swapped)(params))
    assert w.shape == (256, 128)


class WeightLeftDot(nn.Module):
    """``lax.dot_general`` with the weight as lhs (no einsum to reorder it), optionally
    with a batch dim (one weight per batch element: per-expert dense GEMMs)."""

    batched: bool = False

    @nn.compact
    def __call__(self, x):
        init = nn.initializers.lecun_normal()
        if self.batched:  # w [E, N, K] · x [E, T, K] -> [E, N, T]
            w = self.param("w", init, (2, 256, x.shape[-1]))
            return jax.lax.dot_general(w, x.reshape(2, -1, x.shape[-1]),
                                       (((2,), (2,)), ((0,), (0,))))
        w = self.param("w", init, (256, x.shape[-1]))  # w [N, K] · x [T, K] -> [N, T]
        return jax.lax.dot_general(w, x, (((1,), (1,)), ((), ())))


@pytest.mark.slow
@pytest.mark.parametrize("batched", [False, True], ids=["2d", "batched"])
def test_dot_general_with_the_weight_as_lhs_is_swapped_to_the_weight_side(batched):
    params = WeightLeftDot(batched).init(jax.random.key(0), X)
    model = qwix.quantize_model(WeightLeftDot(batched), _rules("blockwise", ".*"))
    dg = fp8.dot_general_fn("blockwise")

    def ref(p):  # x · wᵀ with w as fmtkit's weight (128x128 blocks), transposed back
        w = p["params"]["w"]
        if batched:
            y = dg(X.reshape(2, -1, X.shape[-1]), w, (((2,), (2,)), ((0,), (0,))))
            return jnp.mean(jnp.square(y.transpose(0, 2, 1)))
        return jnp.mean(jnp.square(dg(X, w, (((1,), (1,)), ((), ()))).T))

    def unswapped(p):  # w as fmtkit's activation operand (1x128 tiles)
        if batched:
            return jnp.mean(jnp.square(dg(p["params"]["w"], X.reshape(2, -1, X.shape[-1]),
                                          (((2,), (2,)), ((0,), (0,))))))
        return jnp.mean(jnp.square(dg(p["params"]["w"], X, (((1,), (1,)), ((), ())))))

    got = jax.jit(jax.value_and_grad(lambda p: jnp.mean(jnp.square(model.apply(p, X)))))(
        params)
    assert _equal(got, jax.jit(jax.value_and_grad(ref))(params))
    assert not _equal(got[0], jax.jit(unswapped)(params))


class Experts(nn.Module):
    groups: int = 4

    @nn.compact
    def __call__(self, x, group_sizes):
        w = self.param("w", nn.initializers.lecun_normal(), (self.groups, x.shape[-1], 192))
        return jax.lax.ragged_dot(x, w, group_sizes)


GS = jnp.array([10, 0, 30, 24], jnp.int32)


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["current", "blockwise"])
def test_ragged_dot_runs_fmtkits_grouped_gemm_with_per_expert_scales(recipe):
    params = Experts().init(jax.random.key(0), X, GS)
    # Experts of very different ranges: one shared scale would flush the small ones.
    params = jax.tree.map(lambda w: w * jnp.array([1.0, 1.0, 1e-4, 1e3])[:, None, None],
                          params)
    model = qwix.quantize_model(Experts(), _rules(recipe, ".*"))

    def loss(apply):
        return lambda p: jnp.mean(jnp.square(apply(p)))

    got = jax.jit(jax.value_and_grad(loss(lambda p: model.apply(p, X, GS))))(params)
    want = jax.jit(jax.value_and_grad(loss(lambda p: fp8.ragged_dot(
        X, p["params"]["w"], GS, recipe))))(params)
    assert _equal(got, want)


@pytest.mark.slow
def test_ragged_dot_with_an_fp4_recipe_is_refused():
    model = qwix.quantize_model(Experts(), _rules("nvfp4", ".*"))
    with pytest.raises(ValueError, match="FP4 recipes have no grouped GEMM"):
        model.init(jax.random.key(0), X, GS)


@pytest.mark.slow
def test_ragged_dot_group_offset_is_refused():
    class Off(nn.Module):
        @nn.compact
        def __call__(self, x):
            w = self.param("w", nn.initializers.lecun_normal(), (4, x.shape[-1], 8))
            return jax.lax.ragged_dot(x, w, GS, group_offset=jnp.array([0], jnp.int32))

    with pytest.raises(ValueError, match="group_offset"):
        qwix.quantize_model(Off(), _rules("current", ".*")).init(jax.random.key(0), X)


# ---------------------------------------------------------------------------------------
# FP8 operands by provenance in the forward, data-gradient and weight-gradient GEMMs.


def _gemms(model, params, x, *args):
    """(role, lhs FP8, rhs FP8, shapes) of every matmul of the loss and its vjp with respect
    to the parameters and the input ``x``."""
    def step(p, x, ct):
        value, pullback = jax.vjp(
            lambda q, x: jnp.mean(jnp.square(model.apply(q, x, *args))), p, x)
        return value, pullback(ct)

    closed = jax.make_jaxpr(step)(params, x, jnp.float32(1))
    n = len(jax.tree.leaves(params))
    records, outs = label_eqns(closed, [{PARAM}] * n + [{DATA}, {COTANGENT}])
    fp8s = fp8_operands(closed)
    grads = frozenset().union(*outs[1:1 + n])  # the parameter gradients
    found = []
    for rec in records:
        if id(rec.eqn) in fp8s:
            lhs, rhs, _ = fp8s[id(rec.eqn)]
            shapes = tuple(tuple(v.aval.shape) for v in rec.eqn.invars[:2])
            found.append((matmul_role(rec, -1, grads), lhs, rhs, shapes))
    return found


def _assert_fp8_in_all_three(found, unmatched_size):
    """Every matmul of a matched module (none of its operands has a dim of
    ``unmatched_size``, the unmatched head's width) takes FP8 operands, and there are
    forward, data-gradient and weight-gradient ones; the head's take none."""
    roles = {}
    for role, lhs, rhs, shapes in found:
        if unmatched_size in {d for s in shapes for d in s}:  # the head: as written, in f32
            assert not (lhs or rhs), (role, shapes)
            continue
        roles.setdefault(role, []).append(lhs and rhs)
    assert set(roles) == {"fwd", "dgrad", "wgrad"}, roles
    assert all(all(v) for v in roles.values()), roles


@pytest.mark.slow
@pytest.mark.parametrize("recipe", RECIPES)
def test_matched_gemms_take_fp8_operands_in_forward_dgrad_and_wgrad(recipe, monkeypatch):
    params = Mlp().init(jax.random.key(0), X)
    model = qwix.quantize_model(Mlp(), _rules(recipe))
    _assert_fp8_in_all_three(_gemms(model, params, X), 10)
    # Negative control: the provider running the dots as written is caught.
    monkeypatch.setattr(FmtkitProvider, "_fp8_dot", lambda self, *a: None)
    with pytest.raises(AssertionError):
        _assert_fp8_in_all_three(_gemms(qwix.quantize_model(Mlp(), _rules(recipe)),
                                        params, X), 10)


@pytest.mark.slow
def test_walker_does_not_count_quantize_dequantize_as_fp8():
    """A dot of qdq'd operands (FP8 values times their scale, then a float dot) is not an FP8
    GEMM: the walker must not be fooled by the FP8 arrays one multiply upstream."""
    import fmtkit

    def f(x, w):
        sx = fmtkit.quantize(x, "e4m3")
        sw = fmtkit.quantize(w, "e4m3")
        return fmtkit.dequantize(sx) @ fmtkit.dequantize(sw)

    closed = jax.make_jaxpr(f)(X, jnp.ones((128, 8)))
    assert [v[:2] for v in fp8_operands(closed).values()] == [(False, False)]
    g = jax.make_jaxpr(lambda x, w: jax.lax.dot_general(
        x.astype(jnp.float8_e4m3fn).astype(jnp.bfloat16),
        w.astype(jnp.float8_e4m3fn).astype(jnp.bfloat16), (((1,), (0,)), ((), ())),
        preferred_element_type=jnp.float32))(X, jnp.ones((128, 8)))
    assert [v[:2] for v in fp8_operands(g).values()] == [(True, True)]


@pytest.mark.slow
def test_grouped_gemms_take_fp8_operands_in_forward_dgrad_and_wgrad():
    params = Experts().init(jax.random.key(0), X, GS)
    model = qwix.quantize_model(Experts(), _rules("blockwise", ".*"))
    _assert_fp8_in_all_three(_gemms(model, params, X, GS), -1)


class Attention(nn.Module):
    """q·kᵀ (two activations) and a convolution inside a matched module."""

    dg: object = None

    @nn.compact
    def __call__(self, x):
        kw = {} if self.dg is None else {"dot_general": self.dg}
        q = nn.Dense(64, name="q", **kw)(x)
        k = nn.Dense(64, name="k", **kw)(x)
        scores = jnp.einsum("td,sd->ts", q, k)
        conv = nn.Conv(4, (3,), name="conv")(x[None, :, :8])
        return jnp.sum(jax.nn.softmax(scores)) + jnp.sum(conv)


@pytest.mark.slow
def test_activation_products_and_convolutions_stay_as_written():
    params = Attention().init(jax.random.key(0), X)

    def vg(model):
        return jax.jit(jax.value_and_grad(lambda p: model.apply(p, X)))(params)

    got = vg(qwix.quantize_model(Attention(), _rules("current", ".*")))
    # The projections in FP8 (fmtkit by hand), the score einsum and the conv as written.
    assert _equal(got, vg(Attention(dg=fp8.dot_general_fn("current"))))
    assert not _equal(got, vg(Attention()))
