"""fmtkit.fp8.ragged_dot, the grouped FP8 GEMM, against a float64 NumPy reference that
quantizes with ml_dtypes from the definitions (scale = amax / format max per tile; one scale
per group for a per-tensor weight stack), and under FP8 policies read by a jaxpr walker."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jaxpr_utils import iter_eqns, operand_dtypes

from fmtkit import fp8
from fmtkit._lowp import grouped
from fmtkit._switches import flipped
from fmtkit.policy import inspect_policy, with_policy

E4M3, E5M2 = ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2
MAX = {E4M3: 448.0, E5M2: 57344.0}
RNG = np.random.default_rng(3)
M, K, N = 300, 200, 136  # K and N not multiples of 128 (padded inside the GEMMs)
SIZES = np.array([100, 0, 150, 40], np.int32)  # uneven, one empty group, 10 rows past the end
RANGES = np.array([1.0, 30.0, 1e-3, 3.0])  # experts of ranges 3e4 apart
X = RNG.standard_normal((M, K)).astype(np.float32)
W = (RNG.standard_normal((4, K, N)) * RANGES[:, None, None]).astype(np.float32)
DY = RNG.standard_normal((M, N)).astype(np.float32)


def _qdq(t: np.ndarray, fmt, bm: int, bn: int) -> np.ndarray:
    """``t`` [R, C] quantized to ``fmt`` with one scale per ``bm x bn`` block (0: the whole
    dimension), dequantized in float64: scale = f32(amax) * f32(1 / max) (1 for an all-zero
    block), values = fmt(clip(t * (1 / scale), ±max))."""
    r, c = t.shape
    bm, bn = bm or r, bn or c
    rp, cp = -(-r // bm) * bm, -(-c // bn) * bn
    p = np.zeros((rp, cp), np.float32)
    p[:r, :c] = t
    blocks = p.reshape(rp // bm, bm, cp // bn, bn)
    amax = np.abs(blocks).max(axis=(1, 3), keepdims=True).astype(np.float32)
    scale = np.where(amax > 0, amax * np.float32(1 / MAX[fmt]), np.float32(1)).astype(np.float32)
    inv = np.float32(1) / scale
    vals = np.clip(blocks * inv, -MAX[fmt], MAX[fmt]).astype(fmt)
    return (vals.astype(np.float64) * scale.astype(np.float64)).reshape(rp, cp)[:r, :c]


def _rows(sizes):
    ends = np.cumsum(sizes)
    return [slice(e - s, e) for s, e in zip(sizes, ends)]


def _reference(recipe: str):
    """(y, dx, dw) in float64 from operands quantized as the recipe defines them."""
    if recipe == "current":  # per tensor; the weight stack one scale per group; E5M2 grads
        xf = xw = _qdq(X, E4M3, 0, 0)
        ws = [_qdq(w.T, E4M3, 0, 0).T for w in W]  # w[g] as [N, K], per tensor
        gf = gw = _qdq(DY, E5M2, 0, 0)
    else:  # blockwise: 1x128 along each GEMM's contraction, 128x128 weight blocks, E4M3
        xf, xw = _qdq(X, E4M3, 1, 128), _qdq(X, E4M3, 128, 1)
        ws = [_qdq(w, E4M3, 128, 128) for w in W]
        gf, gw = _qdq(DY, E4M3, 1, 128), _qdq(DY, E4M3, 128, 1)
    y, dx = np.zeros((M, N)), np.zeros((M, K))
    dw = np.zeros(W.shape)
    for g, rows in enumerate(_rows(SIZES)):
        y[rows] = xf[rows] @ ws[g]
        dx[rows] = gf[rows] @ ws[g].T
        dw[g] = xw[rows].T @ gw[rows]
    return y, dx, dw


def _bound(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """An f32 summation bound for products of ``a`` and ``b`` (|a| @ |b| times 2^-20)."""
    return np.abs(a) @ np.abs(b) * 2.0**-20 + 1e-30


def _run(recipe: str):
    gs = jnp.asarray(SIZES)
    y, pullback = jax.vjp(lambda x, w: fp8.ragged_dot(x, w, gs, recipe), jnp.asarray(X),
                          jnp.asarray(W))
    dx, dw = pullback(jnp.asarray(DY))
    return np.asarray(y, np.float64), np.asarray(dx, np.float64), np.asarray(dw, np.float64)


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["current", "blockwise"])
def test_forward_dgrad_wgrad_match_the_float64_reference(recipe):
    y, dx, dw = _run(recipe)
    ry, rdx, rdw = _reference(recipe)
    scale = max(np.abs(ry).max(), 1.0)
    np.testing.assert_allclose(y, ry, rtol=2e-6, atol=2e-6 * scale)
    np.testing.assert_allclose(dx, rdx, rtol=2e-6, atol=2e-6 * np.abs(rdx).max())
    for g in range(4):  # per group: the 0.01-range expert's gradient is small
        np.testing.assert_allclose(dw[g], rdw[g], rtol=2e-6,
                                   atol=2e-6 * max(np.abs(rdw[g]).max(), 1e-30))
    assert not dw[1].any()  # the empty group gets a zero gradient
    assert not y[SIZES.sum():].any() and not dx[SIZES.sum():].any()  # rows past the groups


def _small_expert_error() -> float:
    """The relative error of the forward rows of the 1e-3-range expert against f64 x @ w."""
    y, _, _ = _run("current")
    small = _rows(SIZES)[2]
    want = X[small].astype(np.float64) @ W[2]
    return float(np.linalg.norm(y[small] - want) / np.linalg.norm(want))


def test_the_small_expert_keeps_its_own_scale():
    """One scale per group: the expert 3e4 times smaller than the largest is quantized with
    its own amax, as accurate (relative) as the others (E4M3: about 4%)."""
    assert _small_expert_error() < 0.05


def test_one_scale_for_all_groups_fails_the_reference(monkeypatch):
    """Mutation: the weight stack quantized with one amax for all groups: the small expert
    falls into E4M3's subnormals."""
    orig = grouped._amax
    monkeypatch.setattr(grouped, "_amax", lambda t, recipe, axes=None: jnp.broadcast_to(
        orig(t, recipe), orig(t, recipe, axes).shape))
    y, _, _ = _run("current")
    ry, _, _ = _reference("current")
    assert not np.allclose(y, ry, rtol=2e-6, atol=2e-6 * np.abs(ry).max())
    assert _small_expert_error() > 0.1


def test_delayed_runs_as_current_with_a_warning_and_fp4_is_refused():
    gs = jnp.asarray(SIZES)
    x, w = jnp.asarray(X[:, :128]), jnp.asarray(W[:, :128, :16])
    with pytest.warns(UserWarning, match="delayed recipe delayed runs as current scaling"):
        got = fp8.ragged_dot(x, w, gs, "delayed")
    np.testing.assert_array_equal(np.asarray(got), np.asarray(fp8.ragged_dot(x, w, gs,
                                                                              "current")))
    with pytest.raises(ValueError, match="recipe='nvfp4': FP4 recipes have no grouped GEMM"):
        fp8.ragged_dot(x, w, gs, "nvfp4")


@pytest.mark.parametrize("args, err, match", [
    (dict(group_sizes=jnp.asarray(SIZES, jnp.float32)), TypeError,
     "group_sizes must be an integer array"),
    (dict(group_sizes=jnp.asarray(SIZES[:3])), ValueError,
     r"group_sizes must have shape \(G,\) = \(4,\)"),
    (dict(group_sizes=jnp.asarray(SIZES)[None]), ValueError, "group_sizes must have shape"),
    (dict(rhs=jnp.ones((128, 16))), ValueError, r"rhs must be 3-D \(\[G, K, N\]"),
    (dict(lhs=jnp.ones((4, 2, 128))), ValueError, "lhs must be 2-D"),
    (dict(lhs=jnp.ones((8, 64))), ValueError, "must share K: lhs has 64, rhs has 128"),
    (dict(lhs=jnp.ones((8, 128), jnp.int32)), TypeError, "lhs must be a real floating"),
])
def test_bad_input_is_named(args, err, match):
    kw = dict(lhs=jnp.ones((8, 128)), rhs=jnp.ones((4, 128, 16)), group_sizes=jnp.asarray(SIZES))
    kw.update(args)
    with pytest.raises(err, match=match):
        fp8.ragged_dot(kw["lhs"], kw["rhs"], kw["group_sizes"], "current")


# ---------------------------------------------------------------------------------------------
# An MoE layer under the policy: tokens sorted by expert, ragged up and down projections.

E, D, F, T = 4, 128, 256, 96
MOE_SIZES = jnp.array([40, 0, 50, 6], jnp.int32)
MOE = {"up": jnp.asarray(RNG.standard_normal((E, D, F)) / 11, jnp.float32),
       "down": jnp.asarray(RNG.standard_normal((E, F, D)) / 16, jnp.float32)}
TOKENS = jnp.asarray(RNG.standard_normal((T, D)), jnp.float32)


def moe_layer(params, x):
    """A megablox-style MoE feed-forward block (tokens already sorted by expert)."""
    h = jax.nn.gelu(jax.lax.ragged_dot(x, params["up"], MOE_SIZES))
    return x + jax.lax.ragged_dot(h, params["down"], MOE_SIZES)


def _loss(fn):
    return lambda p, x: jnp.mean(jnp.square(fn(p, x)))


def _ragged_operands(closed):
    """(lhs dtype, rhs dtype, ragged contraction?) of every ragged_dot_general, read from
    the dtypes that enter it."""
    out = []
    for e in iter_eqns(closed):
        if e.primitive.name == "ragged_dot_general":
            rd = e.params["ragged_dot_dimension_numbers"]
            contract = rd.dot_dimension_numbers[0][0]
            out.append((str(e.invars[0].aval.dtype), str(e.invars[1].aval.dtype),
                        bool(set(rd.lhs_ragged_dimensions) & set(contract))))
    return out


@pytest.mark.parametrize("preset, grad_fmt", [("fp8-current", "float8_e5m2"),
                                               ("fp8-blockwise", "float8_e4m3fn")])
def test_moe_layer_ragged_gemms_are_fp8_forward_and_backward(preset, grad_fmt):
    # FP8 operands enter the dots as FP8 (as on a GPU), so the walker reads their dtypes.
    policied = with_policy(moe_layer, preset)
    with flipped(widen_off_gpu=False):
        closed = jax.make_jaxpr(jax.grad(_loss(policied), argnums=(0, 1)))(MOE, TOKENS)
    ops = _ragged_operands(closed)
    e4 = "float8_e4m3fn"
    # forward up / down and dgrad down / up: groups of rows; wgrad up / down: ragged tokens
    assert sorted(ops) == sorted([(e4, e4, False)] * 2 + [(grad_fmt, e4, False)] * 2
                                 + [(e4, grad_fmt, True)] * 2)


@pytest.mark.slow
def test_moe_layer_fp8_reported_and_close_to_f32():
    policied = with_policy(moe_layer, "fp8-blockwise")
    closed = jax.make_jaxpr(jax.grad(_loss(policied), argnums=(0, 1)))(MOE, TOKENS)
    # off GPUs the dots read the FP8 values widened to bf16, in a scope naming the formats
    assert {operand_dtypes(e) for e in iter_eqns(closed)
            if e.primitive.name == "ragged_dot_general"} == {
        (jnp.dtype("float8_e4m3fn"),) * 2}
    report = inspect_policy(policied, MOE, TOKENS)
    grouped = [m for m in report.matmul_ops if m.primitive == "ragged_dot_general"]
    assert {m.kind for m in grouped} == {"forward", "dgrad", "wgrad"}
    assert all(m.low_precision and m.groups == E for m in grouped)
    fwd = sum(m.flops for m in grouped if m.kind == "forward")
    assert fwd == 2 * (2 * T * D * F)  # each token row once, up and down
    for kind in ("forward", "dgrad", "wgrad"):
        assert report.fp8_fraction(kind) == 1.0
    got = jax.grad(_loss(policied))(MOE, TOKENS)
    want = jax.grad(_loss(moe_layer))(MOE, TOKENS)
    for key in ("up", "down"):
        rel = jnp.linalg.norm(got[key] - want[key]) / jnp.linalg.norm(want[key])
        assert rel < 0.1


@pytest.mark.slow
def test_moe_layer_fp32_is_bit_identical():
    policied = with_policy(moe_layer, "fp32")
    for run in (jax.jit, lambda f: f):
        got = run(jax.value_and_grad(_loss(policied)))(MOE, TOKENS)
        want = run(jax.value_and_grad(_loss(moe_layer)))(MOE, TOKENS)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_moe_layer_routing_negative_control():
    """Mutation: the policy does not recognise lax.ragged_dot's form: the grouped GEMMs run
    on the compute dtype (with the fallback warning), and the walker sees no FP8."""
    policied = with_policy(moe_layer, "fp8-current")
    with flipped(ragged_dot_form=False), \
            pytest.warns(UserWarning, match="ragged_dot .* runs on bfloat16"):
        closed = jax.make_jaxpr(jax.grad(_loss(policied), argnums=(0, 1)))(MOE, TOKENS)
    assert {(a, b) for a, b, _ in _ragged_operands(closed)} == {("bfloat16", "bfloat16")}


def test_gemm_hook_sees_the_grouped_gemm_as_fp8():
    """Under intercept_gemms, a hook that runs what the policy would (site.fp8) computes the
    same bits as the policy without a hook; the ragged sites carry the FP8 recipe."""
    from fmtkit.policy import intercept_gemms

    sites = []

    def hook(site, run, lhs, rhs):
        sites.append((site.primitive, site.fp8_capable, getattr(site.fp8, "name", None)))
        return run(lhs, rhs, site.fp8)

    policied = jax.jit(with_policy(moe_layer, "fp8-current"))
    want = policied(MOE, TOKENS)
    with intercept_gemms(hook):
        got = jax.jit(with_policy(moe_layer, "fp8-current"))(MOE, TOKENS)
    assert sites == [("ragged_dot_general", True, "current")] * 2
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_moe_layer_under_a_delayed_preset_runs_current_scaling_with_one_warning():
    policied = with_policy(moe_layer, "fp8-delayed")
    state = policied.init_fp8_state(MOE, TOKENS)
    with pytest.warns(UserWarning, match="runs with current scaling: the grouped FP8 GEMM "
                                         "keeps no amax history") as caught:
        got = policied(MOE, TOKENS, fp8_state=state)
    assert len(caught) == 1  # one warning for the module, not one per grouped GEMM
    want = with_policy(moe_layer, "fp8-current")(MOE, TOKENS)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_empty_operands_give_zeros():
    gs = jnp.zeros((3,), jnp.int32)
    w = jnp.ones((3, 130, 20))
    y, pullback = jax.vjp(lambda a, b: fp8.ragged_dot(a, b, gs, "blockwise"),
                          jnp.zeros((0, 130)), w)
    dx, dw = pullback(jnp.zeros((0, 20)))
    assert (y.shape, dx.shape, dw.shape) == ((0, 20), (0, 130), (3, 130, 20))
    assert not np.asarray(dw).any()


# ---------------------------------------------------------------------------------------------
# Forward-mode AD: the tangent through the forward GEMM's quantized operands, in f32.

XT = RNG.standard_normal((M, K)).astype(np.float32)  # tangents
WT = (RNG.standard_normal((4, K, N)) * RANGES[:, None, None]).astype(np.float32)


def _forward_operands(recipe: str):
    """Q(x) [M, K] and Q(w[g]) [K, N] per group, as the forward GEMM quantizes them (f64)."""
    if recipe == "current":
        return _qdq(X, E4M3, 0, 0), [_qdq(w.T, E4M3, 0, 0).T for w in W]
    return _qdq(X, E4M3, 1, 128), [_qdq(w, E4M3, 128, 128) for w in W]


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["current", "blockwise"])
def test_jvp_is_the_ragged_product_through_the_quantized_operands(recipe):
    gs = jnp.asarray(SIZES)
    y, yt = jax.jvp(lambda x, w: fp8.ragged_dot(x, w, gs, recipe),
                    (jnp.asarray(X), jnp.asarray(W)), (jnp.asarray(XT), jnp.asarray(WT)))
    xf, ws = _forward_operands(recipe)
    want = np.zeros((M, N))
    for g, rows in enumerate(_rows(SIZES)):  # group 1 is empty
        want[rows] = XT[rows].astype(np.float64) @ ws[g] + xf[rows] @ WT[g]
    got = np.asarray(yt, np.float64)
    assert yt.dtype == y.dtype == jnp.float32
    for rows in _rows(SIZES):  # per group: the experts' ranges differ by 3e4
        tol = 2e-6 * max(np.abs(want[rows]).max(initial=0.0), 1e-30)
        np.testing.assert_allclose(got[rows], want[rows], rtol=2e-6, atol=tol)
    assert not got[SIZES.sum():].any()  # rows past the groups: zero tangent
    # the unquantized operands are a different tangent (E4M3: a few percent)
    plain = np.concatenate([XT[r].astype(np.float64) @ W[g] + X[r].astype(np.float64) @ WT[g]
                            for g, r in enumerate(_rows(SIZES))])
    assert not np.allclose(got[:SIZES.sum()], plain, rtol=1e-3, atol=1e-3)


def test_jvp_of_bf16_operands_is_bf16_and_jit_agrees():
    gs = jnp.asarray(SIZES)
    x, w = jnp.asarray(X[:, :128], jnp.bfloat16), jnp.asarray(W[:, :128, :16], jnp.bfloat16)
    xt, wt = jnp.asarray(XT[:, :128], jnp.bfloat16), jnp.asarray(WT[:, :128, :16], jnp.bfloat16)
    f = jax.jit(lambda a, b, c, d: jax.jvp(lambda p, q: fp8.ragged_dot(p, q, gs, "current"),
                                           (a, b), (c, d)))
    y, yt = f(x, w, xt, wt)
    assert y.dtype == yt.dtype == jnp.bfloat16
    _, yt_eager = jax.jvp(lambda p, q: fp8.ragged_dot(p, q, gs, "current"), (x, w), (xt, wt))
    np.testing.assert_array_equal(np.asarray(yt, np.float32), np.asarray(yt_eager, np.float32))


@pytest.mark.slow
def test_jacfwd_equals_jacrev_and_the_quantized_weights():
    """A tiny grouped GEMM (an empty group, a row past the groups): jacfwd (the tangent) and
    jacrev (the FP8 backward; a one-hot cotangent quantizes exactly) agree; d y[m] / d x[m]
    is Q(w[g(m)])ᵀ."""
    rng = np.random.default_rng(5)
    sizes = np.array([2, 0, 3], np.int32)
    x = rng.standard_normal((6, 8)).astype(np.float32)
    w = (rng.standard_normal((3, 8, 3)) * np.array([1.0, 5.0, 0.01])[:, None, None]
         ).astype(np.float32)
    gs = jnp.asarray(sizes)

    def f(a, b):
        return fp8.ragged_dot(a, b, gs, "current")

    fwd = jax.jacfwd(f, argnums=(0, 1))(jnp.asarray(x), jnp.asarray(w))
    rev = jax.jacrev(f, argnums=(0, 1))(jnp.asarray(x), jnp.asarray(w))
    for a, b in zip(fwd, rev):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
    jx = np.asarray(fwd[0], np.float64)  # [6, 3, 6, 8]
    for g, rows in enumerate(_rows(sizes)):
        qw = _qdq(w[g].T, E4M3, 0, 0)  # [N, K], one scale per group
        for m in range(rows.start, rows.stop):
            np.testing.assert_allclose(jx[m, :, m, :], qw, rtol=1e-6)
    assert not jx[5].any()  # the row past the groups
    assert np.count_nonzero(jx) == np.count_nonzero(
        [jx[m, :, m, :] for m in range(6)])  # no row reads another row


@pytest.mark.slow
def test_hvp_of_a_quadratic_loss_is_the_quantized_gauss_newton_product():
    """L = ½‖y‖², y = ragged_dot(x, w): the Hessian-vector product in w along v, forward over
    reverse, is per group Q(x)_gᵀ · (Q(x)_g · v_g) (the wgrad's tangent through the forward's
    quantized x, the cotangent's quantization's derivative the identity). Reverse over
    reverse and reverse over forward run the FP8 wgrad on the tangent Q(x)_g · v_g (its E5M2
    quantization: a few percent off), the two the same bits."""
    gs = jnp.asarray(SIZES)

    def loss(w):
        return 0.5 * jnp.sum(jnp.square(fp8.ragged_dot(jnp.asarray(X), w, gs, "current")))

    w, v = jnp.asarray(W), jnp.asarray(WT)
    fwd_rev = np.asarray(jax.jvp(jax.grad(loss), (w,), (v,))[1], np.float64)
    rev_rev = np.asarray(jax.grad(lambda p: jnp.vdot(jax.grad(loss)(p), v))(w), np.float64)
    rev_fwd = np.asarray(jax.grad(lambda p: jax.jvp(loss, (p,), (v,))[1])(w), np.float64)
    np.testing.assert_array_equal(rev_rev, rev_fwd)
    xf, _ = _forward_operands("current")
    for g, rows in enumerate(_rows(SIZES)):
        want = xf[rows].T @ (xf[rows] @ WT[g])
        scale = max(np.abs(want).max(initial=0.0), 1e-30)
        np.testing.assert_allclose(fwd_rev[g], want, rtol=1e-5, atol=1e-5 * scale)
        if g != 1:
            rel = np.linalg.norm(rev_rev[g] - want) / np.linalg.norm(want)
            assert 1e-3 < rel < 0.1, (g, rel)  # E5M2 cotangent: about 4-5% here
    assert not fwd_rev[1].any() and not rev_rev[1].any()  # the empty group


@pytest.mark.slow
def test_reverse_mode_is_the_fp8_backward_bit_for_bit():
    """jax.vjp of ragged_dot returns exactly the grouped FP8 backward's dgrad and wgrad, and
    traces only the GEMMs of the operands that need a gradient."""
    gs = jnp.asarray(SIZES)
    x, w, dy = jnp.asarray(X[:, :160]), jnp.asarray(W[:, :160, :40]), jnp.asarray(DY[:, :40])
    for recipe in ("current", "blockwise"):
        _, pullback = jax.vjp(lambda a, b, r=recipe: fp8.ragged_dot(a, b, gs, r), x, w)
        got = pullback(dy)
        want = grouped._backward_gemms(fp8.get_recipe(recipe), x, w, gs, dy, True, True)
        for a, b in zip(got, want):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    def count(argnums):
        loss = lambda a, b: jnp.sum(fp8.ragged_dot(a, b, gs, "current"))  # noqa: E731
        closed = jax.make_jaxpr(jax.grad(loss, argnums=argnums))(x, w)
        return sum(e.primitive.name == "ragged_dot_general" for e in iter_eqns(closed))

    assert (count(0), count(1), count((0, 1))) == (2, 2, 3)  # forward + dgrad / wgrad / both


@pytest.mark.slow
def test_moe_layer_hvp_under_fp8_current_matches_the_f32_finite_difference():
    """Forward over reverse through the policied MoE layer (both ragged dots on the grouped
    FP8 GEMM): the HVP is within 10% (relative norm; E4M3 operands give about 5-6%) of the
    central finite difference of the f32 layer's gradients (which is within 2e-4 of the
    exact f32 HVP at this step), and so is the forward-mode tangent of the layer."""
    vrng = np.random.default_rng(9)
    v = {k: jnp.asarray(vrng.standard_normal(p.shape), jnp.float32) * jnp.std(p)
         for k, p in MOE.items()}
    policied = with_policy(moe_layer, "fp8-current")
    _, hvp = jax.jvp(jax.grad(lambda p: _loss(policied)(p, TOKENS)), (MOE,), (v,))
    grad32 = jax.grad(lambda p: _loss(moe_layer)(p, TOKENS))
    eps = 1e-3
    plus = grad32({k: MOE[k] + eps * v[k] for k in MOE})
    minus = grad32({k: MOE[k] - eps * v[k] for k in MOE})
    for k in MOE:
        fd = (np.asarray(plus[k], np.float64) - np.asarray(minus[k], np.float64)) / (2 * eps)
        rel = np.linalg.norm(np.asarray(hvp[k], np.float64) - fd) / np.linalg.norm(fd)
        assert rel < 0.1, (k, rel)
    _, yt = jax.jvp(lambda p: policied(p, TOKENS), (MOE,), (v,))
    _, yt32 = jax.jvp(lambda p: moe_layer(p, TOKENS), (MOE,), (v,))
    assert jnp.linalg.norm(yt - yt32) / jnp.linalg.norm(yt32) < 0.1


def test_vmap_is_the_per_example_grouped_gemm():
    """vmap over a batch of token sets (weights shared, or one stack each) runs the grouped
    GEMM per example: the same bits as a loop (JAX's own ragged_dot batching maps no
    operand whose ragged or group axis would move)."""
    gs = jnp.asarray(np.array([3, 0, 4], np.int32))
    xs = jnp.asarray(RNG.standard_normal((2, 8, 128)), jnp.float32)
    ws = jnp.asarray(RNG.standard_normal((2, 3, 128, 16)), jnp.float32)

    def f(a, b):
        return fp8.ragged_dot(a, b, gs, "blockwise")

    shared = jax.vmap(f, in_axes=(0, None))(xs, ws[0])
    each = jax.vmap(f)(xs, ws)
    for i in range(2):
        np.testing.assert_array_equal(np.asarray(shared[i]), np.asarray(f(xs[i], ws[0])))
        np.testing.assert_array_equal(np.asarray(each[i]), np.asarray(f(xs[i], ws[i])))
