"""The programs JAX users write, under the policy: no crash, no silent change.

Each construct is a short program as a user would write it. Matmul dtypes are read from the
jaxpr of the gradient with ``jaxpr_utils`` (a walker that knows nothing of the policy);
``fp32`` is compared bit for bit with the unwrapped program; each handling has a negative
control, a mutation of it (the new rule switched off: ``fmtkit._switches``) under which the
same check fails.
"""

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from child_env import child_env
from jaxpr_utils import iter_eqns, matmul_flops, operand_dtypes

from fmtkit._switches import flipped
from fmtkit.policy import inspect_policy, with_policy

BF16, F32 = jnp.dtype("bfloat16"), jnp.dtype("float32")
E4M3, E5M2 = jnp.dtype("float8_e4m3fn"), jnp.dtype("float8_e5m2")
MATMULS = ("dot_general", "conv_general_dilated", "ragged_dot", "ragged_dot_general")
RNG = np.random.default_rng(0)
X = jnp.asarray(RNG.standard_normal((4, 8)), jnp.float32)
PARAMS = {"w": jnp.asarray(RNG.standard_normal((8, 8)) / 3, jnp.float32),
          "o": jnp.asarray(RNG.standard_normal((8, 3)), jnp.float32)}


def _matmuls(closed, skip_head: bool = True):
    """(primitive, lhs dtype, rhs dtype) of every matmul-like equation, sub-jaxprs
    included; ``skip_head``: without the [8, 3] head's matmuls (its 3 outputs appear in no
    other matmul)."""
    return [(e.primitive.name, *operand_dtypes(e)) for e in iter_eqns(closed)
            if e.primitive.name in MATMULS
            and not (skip_head and any(3 in v.aval.shape for v in e.invars[:2]))]


def _grad_jaxpr(fn, *args):
    return jax.make_jaxpr(jax.grad(lambda *a: jnp.sum(fn(*a))))(*args)


def _assert_fp32_identity(model, *args):
    """The "fp32" policied program computes bit for bit what the unwrapped one computes,
    values and gradients, jitted and eager."""
    policied = with_policy(model, "fp32")

    def vg(f):
        return jax.value_and_grad(lambda *a: jnp.sum(f(*a)))

    for run in (jax.jit, lambda f: f):
        got, want = run(vg(policied))(*args), run(vg(model))(*args)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ---------------------------------------------------------------------------------------------
# custom_vjp written the documented way, custom_jvp around a matmul, nested policies.

@jax.custom_vjp
def sin_mul(x, y):
    return jnp.sin(x) * y


def _sin_mul_fwd(x, y):  # JAX's documentation: the forward rule calls the function itself
    return sin_mul(x, y), (jnp.cos(x), jnp.sin(x), y)


def _sin_mul_bwd(res, g):
    cos_x, sin_x, y = res
    return cos_x * g * y, sin_x * g


sin_mul.defvjp(_sin_mul_fwd, _sin_mul_bwd)


@jax.custom_vjp
def dense(x, w):
    return x @ w


def _dense_fwd(x, w):
    return dense(x, w), (x, w)


def _dense_bwd(res, g):
    x, w = res
    return g @ w.T, x.T @ g


dense.defvjp(_dense_fwd, _dense_bwd)


def vjp_model(params, x):
    h = dense(x, params["w"])
    return sin_mul(h, jnp.ones_like(h)) @ params["o"]


@jax.custom_jvp
def jvp_dense(x, w):
    return x @ w


@jvp_dense.defjvp
def _jvp_dense_rule(primals, tangents):
    (x, w), (dx, dw) = primals, tangents
    return x @ w, dx @ w + x @ dw


def jvp_model(params, x):
    return jnp.tanh(jvp_dense(x, params["w"])) @ params["o"]


def test_custom_vjp_written_the_documented_way_runs_under_every_policy():
    _assert_fp32_identity(vjp_model, PARAMS, X)
    closed = _grad_jaxpr(with_policy(vjp_model, "bf16-mixed"), PARAMS, X)
    # The forward matmul (the forward rule's), the user's dgrad and wgrad: all bf16.
    assert _matmuls(closed) == [("dot_general", BF16, BF16)] * 3


def test_custom_vjp_backward_rule_runs_on_the_compute_dtype_negative_control():
    """Mutation: the user's backward rule run as written (the previous handling)."""
    with flipped(interpret_vjp_backward=False):
        closed = _grad_jaxpr(with_policy(vjp_model, "bf16-mixed"), PARAMS, X)
    assert _matmuls(closed) != [("dot_general", BF16, BF16)] * 3


def test_custom_jvp_rule_matmuls_follow_the_policy():
    _assert_fp32_identity(jvp_model, PARAMS, X)
    closed = _grad_jaxpr(with_policy(jvp_model, "bf16-mixed"), PARAMS, X)
    found = _matmuls(closed)
    assert len(found) >= 3 and set(found) == {("dot_general", BF16, BF16)}, found


def test_custom_jvp_rule_negative_control():
    """Mutation: no traced rule, so the rule runs as written (f32 matmuls), with a warning
    naming the construct and the module."""
    with (flipped(trace_jvp_rules=False),
          pytest.warns(UserWarning, match="custom_jvp around a matmul in module '<root>'")):
        closed = _grad_jaxpr(with_policy(jvp_model, "bf16-mixed"), PARAMS, X)
    assert ("dot_general", F32, F32) in _matmuls(closed)


def _inner(params, x):
    return x @ params["w"]


def nested_model(params, x):
    inner = with_policy(_inner, "fp32")
    return jnp.tanh(inner(params, x)) @ params["w"] @ params["o"]


def test_nested_policied_function_keeps_its_own_policy():
    """An inner ``with_policy(fn, "fp32")`` inside an outer bf16 policy: the inner matmul
    runs f32, forward and backward; the outer one bf16."""
    closed = _grad_jaxpr(with_policy(nested_model, "bf16-mixed"), PARAMS, X)
    found = _matmuls(closed)
    # inner: forward and wgrad (x is data: no dgrad)
    assert found.count(("dot_general", F32, F32)) == 2, found
    assert found.count(("dot_general", BF16, BF16)) == 3, found  # outer: fwd, dgrad, wgrad
    _assert_fp32_identity(nested_model, PARAMS, X)


def test_nested_policied_function_negative_control():
    """Mutation: the inner call not told it runs inside an outer trace: the outer policy
    then overrides it (every matmul bf16)."""
    with flipped(nested_policies=False):
        closed = _grad_jaxpr(with_policy(nested_model, "bf16-mixed"), PARAMS, X)
    assert ("dot_general", F32, F32) not in _matmuls(closed)


# ---------------------------------------------------------------------------------------------
# Wide-only operations: FFT, linear algebra, host callbacks get their traced dtypes.

def fft_model(params, x):
    h = x @ params["w"]
    return jnp.abs(jnp.fft.rfft(h, axis=0)) @ params["o"]


def eigh_model(params, x):
    h = x @ params["w"]
    evals, evecs = jnp.linalg.eigh(h.T @ h)
    return (evecs * evals[None, :]) @ params["o"]


def linalg_model(params, x):
    h = x @ params["w"]
    g = h.T @ h + 8 * jnp.eye(8, dtype=h.dtype)
    c = jnp.linalg.cholesky(g)
    q, r = jnp.linalg.qr(g)
    u, s, vt = jnp.linalg.svd(g)
    t = jax.scipy.linalg.solve_triangular(c, q, lower=True)
    lu = jax.scipy.linalg.lu_factor(g)[0]
    return (t + r + u * s[None, :] + vt + lu + jnp.linalg.solve(g, c)) @ params["o"]


def _host_tanh(a):
    assert a.dtype == np.float32, a.dtype  # the dtype it was traced with
    return np.tanh(a)


def callback_model(params, x):
    h = x @ params["w"]
    t = jax.pure_callback(_host_tanh, jax.ShapeDtypeStruct(h.shape, h.dtype),
                          jax.lax.stop_gradient(h))
    return (h + t) @ params["o"]


WIDE = {"fft": (fft_model, "fft"), "eigh": (eigh_model, "eigh"),
        "linalg": (linalg_model, "cholesky"), "callback": (callback_model, "pure_callback")}


def _wide_inputs(closed, name):
    return {v.aval.dtype for e in iter_eqns(closed) if e.primitive.name == name
            for v in e.invars if jnp.issubdtype(v.aval.dtype, jnp.floating)}


@pytest.mark.parametrize("case", sorted(WIDE))
def test_wide_ops_get_their_traced_dtype(case):
    model, prim = WIDE[case]
    _assert_fp32_identity(model, PARAMS, X)
    policied = with_policy(model, "bf16-mixed")
    forward = jax.make_jaxpr(policied)(PARAMS, X)
    assert _wide_inputs(forward, prim) == {F32}
    # The model's own matmuls on bf16 (the derivatives of eigh, svd, ... that JAX writes, and
    # the body of jnp.linalg.solve's custom_linear_solve, run in the traced dtype).
    found = _matmuls(forward)
    projections = 1 if case in ("fft", "callback") else 2
    assert found.count(("dot_general", BF16, BF16)) == projections, found
    if case != "linalg":
        assert set(found) == {("dot_general", BF16, BF16)}
    if case != "callback":
        assert _wide_inputs(_grad_jaxpr(policied, PARAMS, X), prim) == {F32}
    out = policied(PARAMS, X)
    assert out.dtype == F32 and bool(jnp.all(jnp.isfinite(out)))


def test_wide_ops_negative_control():
    """Mutation: the wide class follows its inputs: rfft receives bf16, which JAX refuses."""
    with flipped(wide_ops_as_traced=False), pytest.raises(ValueError, match="bfloat16"):
        jax.make_jaxpr(with_policy(fft_model, "bf16-mixed"))(PARAMS, X)


# ---------------------------------------------------------------------------------------------
# The author's explicit precision requests.

def _dots(closed):
    """(lhs dtype, rhs dtype, result dtype, precision) of every dot_general."""
    return [(*(v.aval.dtype for v in e.invars[:2]), e.outvars[0].aval.dtype,
             e.params["precision"]) for e in iter_eqns(closed)
            if e.primitive.name == "dot_general"]


def wide_result_model(params, x):
    h = (x @ params["w"]).astype(jnp.bfloat16)
    return jnp.einsum("ij,kj->ik", h, h, preferred_element_type=jnp.float32)


def test_wider_preferred_element_type_is_kept():
    _assert_fp32_identity(wide_result_model, PARAMS, X)
    closed = jax.make_jaxpr(with_policy(wide_result_model, "bf16-mixed"))(PARAMS, X)
    assert _dots(closed) == [(BF16, BF16, BF16, None), (BF16, BF16, F32, None)]


def test_wider_preferred_element_type_negative_control():
    # (times the input, so the Gram matrix is not the output head, whose result is f32 by role)
    with flipped(keep_asked_wide_output=False):
        closed = jax.make_jaxpr(with_policy(lambda p, x: wide_result_model(p, x) * x[:, :1],
                                            "bf16-mixed"))(PARAMS, X)
    assert _dots(closed)[1] == (BF16, BF16, BF16, None)


def _highest_model(params, x):
    return jnp.dot(jnp.tanh(x @ params["w"]), params["w"],
                   precision=jax.lax.Precision.HIGHEST) @ params["o"]


def _algorithm_model(params, x):
    return jnp.dot(jnp.tanh(x @ params["w"]), params["w"], precision="F32_F32_F32") @ params["o"]


@pytest.mark.parametrize("model", [_highest_model, _algorithm_model])
@pytest.mark.parametrize("preset", ["bf16-mixed", "fp8-current"])
def test_requested_precision_is_honoured_with_a_warning(model, preset):
    _assert_fp32_identity(model, PARAMS, X)
    with pytest.warns(UserWarning, match="module '<root>' asks for .*honoured"):
        closed = _grad_jaxpr(with_policy(model, preset), PARAMS, X)
    found = _matmuls(closed)
    # the requested matmul (forward, dgrad, wgrad) in f32; the first projection (forward,
    # wgrad) is not
    assert found.count(("dot_general", F32, F32)) == 3, found
    assert ("dot_general", F32, F32) != found[0], found


def test_requested_precision_warning_is_silenced_per_module():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", message=".*module '<root>'")
        jax.make_jaxpr(with_policy(_highest_model, "bf16-mixed"))(PARAMS, X)


def test_requested_precision_negative_control():
    with flipped(honour_asked_precision=False):
        closed = _grad_jaxpr(with_policy(_highest_model, "bf16-mixed"), PARAMS, X)
    assert ("dot_general", F32, F32) not in _matmuls(closed)


def _attention(params, q):
    return jax.nn.dot_product_attention(q, q, q, implementation="xla")


Q = jnp.asarray(RNG.standard_normal((2, 6, 2, 8)), jnp.float32)


def _jax_bf16_attention(q):
    qb = q.astype(BF16)
    with jax.numpy_dtype_promotion("standard"):  # JAX's bf16 path promotes bf16 with f32
        return jax.nn.dot_product_attention(qb, qb, qb, implementation="xla")


def test_dot_product_attention_computes_what_jax_computes_for_bf16():
    _assert_fp32_identity(_attention, PARAMS, Q)
    got = with_policy(_attention, "bf16-mixed")(PARAMS, Q)
    want = _jax_bf16_attention(Q)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    closed = jax.make_jaxpr(with_policy(_attention, "bf16-mixed"))(PARAMS, Q)
    logits, out = _dots(closed)
    assert logits == (BF16, BF16, F32, jax.lax.DotAlgorithmPreset.BF16_BF16_F32)
    assert out[:3] == (BF16, BF16, BF16)


def _projected_attention(params, q):
    q = q @ params["w"]
    return jax.nn.dot_product_attention(q, q, q, implementation="xla")


@pytest.mark.parametrize("preset", ["bf16-mixed", "fp8-current"])
def test_dot_product_attention_gradient(preset):
    """The f32 logits' backward runs on the operands' dtype (JAX's own transpose of a bf16 x
    bf16 -> f32 dot with the BF16_BF16_F32 algorithm fails under strict promotion)."""
    _assert_fp32_identity(_projected_attention, PARAMS, Q)
    policied = with_policy(_projected_attention, preset)
    grads = jax.grad(lambda p: jnp.sum(policied(p, Q)))(PARAMS)
    assert bool(jnp.all(jnp.isfinite(grads["w"])))
    closed = _grad_jaxpr(policied, PARAMS, Q)
    assert all(dt in (BF16, jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))
               for m in _matmuls(closed) for dt in m[1:]), _matmuls(closed)


def test_dot_product_attention_gradient_negative_control():
    """Mutation: the f32 logits bound as a plain dot (JAX's own transpose): it fails."""
    policied = with_policy(_projected_attention, "bf16-mixed")
    with flipped(narrow_mixed_backward=False), pytest.raises(Exception, match="promotion"):
        jax.grad(lambda p: jnp.sum(policied(p, Q)))(PARAMS)


def test_dot_product_attention_negative_control():
    with flipped(dpa_f32_logits=False):
        got = with_policy(_attention, "bf16-mixed")(PARAMS, Q)
    want = _jax_bf16_attention(Q)
    assert not np.array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


class _OwnCasts(nn.Module):
    """A model with its own bf16 matmul, a LayerNorm, a softmax: what "fp32" must not
    change, eager or jitted."""

    @nn.compact
    def __call__(self, x):
        h = jax.nn.gelu(nn.LayerNorm()(nn.Dense(16)(x)))
        w = self.param("wb", nn.initializers.normal(), (16, 16))
        h = (h.astype(jnp.bfloat16) @ w.astype(jnp.bfloat16)).astype(jnp.float32) + h
        return nn.Dense(3)(jax.nn.softmax(nn.Dense(16)(h)))


def test_fp32_is_an_exact_identity_eager_and_jitted():
    model = _OwnCasts()
    variables = model.init(jax.random.key(0), X)
    policied = with_policy(model, "fp32")
    for run in (lambda f: f, jax.jit):
        np.testing.assert_array_equal(np.asarray(run(policied.apply)(variables, X)),
                                      np.asarray(run(model.apply)(variables, X)))
    _assert_fp32_identity(lambda v, x: model.apply(v, x), variables, X)


def test_fp32_identity_negative_control():
    """Mutation: "fp32" interpreted like any other rules (the model's bf16 matmul widened)."""
    model = _OwnCasts()
    variables = model.init(jax.random.key(0), X)
    with flipped(fp32_identity=False):
        got = jax.jit(with_policy(model, "fp32").apply)(variables, X)
    assert not np.array_equal(np.asarray(got), np.asarray(jax.jit(model.apply)(variables, X)))


# ---------------------------------------------------------------------------------------------
# Grouped GEMMs (lax.ragged_dot) and every matmul-like primitive counted.

EXPERTS = {"e": jnp.asarray(RNG.standard_normal((2, 8, 8)) / 3, jnp.float32),
           "o": PARAMS["o"]}
GROUPS = jnp.array([1, 3], jnp.int32)


def moe_model(params, x):
    """Megablox-style: rows sorted by expert, one grouped GEMM."""
    return jnp.tanh(jax.lax.ragged_dot(x, params["e"], GROUPS)) @ params["o"]


def _ragged(closed):
    return [operand_dtypes(e) for e in iter_eqns(closed)
            if e.primitive.name == "ragged_dot_general"]


def test_ragged_dot_runs_on_the_compute_dtype_and_is_counted():
    _assert_fp32_identity(moe_model, EXPERTS, X)
    policied = with_policy(moe_model, "bf16-mixed")
    closed = _grad_jaxpr(policied, EXPERTS, X)
    assert _ragged(closed) == [(BF16, BF16)] * 2  # forward, wgrad (x is data)
    report = inspect_policy(policied, EXPERTS, X, argnums=0)
    grouped = [m for m in report.matmul_ops if m.primitive == "ragged_dot_general"]
    # 4 rows x 8 x 8, each row with its group's weights, forward and wgrad
    assert [(m.kind, m.flops, m.groups, m.policied) for m in grouped] == [
        ("forward", 2 * 4 * 8 * 8, 2, True), ("wgrad", 2 * 4 * 8 * 8, 2, True)]
    assert sum(m.flops for m in report.matmul_ops) == sum(
        matmul_flops(e) for e in iter_eqns(closed) if e.primitive.name in MATMULS)


def test_ragged_dot_under_fp8_is_an_fp8_grouped_gemm():
    policied = with_policy(moe_model, "fp8-current")
    closed = _grad_jaxpr(policied, EXPERTS, X)
    # forward and wgrad (x is data) on FP8 operands (fmtkit.fp8.ragged_dot)
    assert sorted(_ragged(closed)) == sorted([(E4M3, E4M3), (E4M3, E5M2)])
    report = inspect_policy(policied, EXPERTS, X, argnums=0)
    grouped = [m for m in report.matmul_ops if m.primitive == "ragged_dot_general"]
    assert [(m.kind, m.low_precision, m.groups) for m in grouped] == [
        ("forward", True, 2), ("wgrad", True, 2)]


def test_ragged_dot_under_fp4_runs_on_the_compute_dtype_with_a_warning():
    policied = with_policy(moe_model, "nvfp4")
    with pytest.warns(UserWarning, match="ragged_dot .*module '<root>' runs on bfloat16, "
                                         "not with the recipe nvfp4: the FP4 recipes"):
        closed = _grad_jaxpr(policied, EXPERTS, X)
    assert _ragged(closed) == [(BF16, BF16)] * 2
    with pytest.warns(UserWarning, match="ragged_dot"):
        report = inspect_policy(policied, EXPERTS, X, argnums=0)
    assert all(not m.low_precision for m in report.matmul_ops
               if m.primitive == "ragged_dot_general")
    assert report.fp8_fraction() < 1


def moe_head(params, x):
    """A grouped GEMM as the output head (no projection after it)."""
    return jax.lax.ragged_dot(jnp.tanh(x), params["e"], GROUPS)


@pytest.mark.parametrize("preset", ["bf16-mixed", "fp8-current"])
def test_ragged_dot_as_the_output_head(preset):
    """The head's wide result with its group sizes kept: f32 output from bf16 operands,
    backward on bf16, forward-mode through it."""
    policied = with_policy(moe_head, preset)
    closed = _grad_jaxpr(policied, EXPERTS, X)
    heads = [e for e in iter_eqns(closed) if e.primitive.name == "ragged_dot_general"]
    assert [operand_dtypes(e) for e in heads] == [(BF16, BF16)] * 2  # forward, wgrad
    assert heads[0].outvars[0].aval.dtype == np.float32
    y, dy = jax.jvp(lambda p: policied(p, X), (EXPERTS,), (EXPERTS,))
    assert y.dtype == dy.dtype == np.float32
    np.testing.assert_allclose(np.asarray(y), np.asarray(moe_head(EXPERTS, X)), rtol=0.05,
                               atol=0.02)


def test_ragged_dot_negative_control():
    """Mutation: ragged_dot_general not a matmul of the policy: it stays f32 and uncounted."""
    with flipped(ragged_dot_matmul=False):
        closed = _grad_jaxpr(with_policy(moe_model, "bf16-mixed"), EXPERTS, X)
    assert _ragged(closed) != [(BF16, BF16)] * 2


def _lax_matmul_calls():
    """A call of every jax.lax function that binds a primitive with matmul FLOPs."""
    lhs, rhs = X, PARAMS["w"]
    img, ker = X.reshape(1, 1, 4, 8), PARAMS["w"][:3, :3].reshape(1, 1, 3, 3)
    dn = (((1,), (0,)), ((), ()))
    return {
        "dot": lambda: jax.lax.dot(lhs, rhs),
        "dot_general": lambda: jax.lax.dot_general(lhs, rhs, dn),
        "batch_matmul": lambda: jax.lax.batch_matmul(lhs[None], rhs[None]),
        "ragged_dot": lambda: jax.lax.ragged_dot(lhs, EXPERTS["e"], GROUPS),
        "ragged_dot_general": lambda: jax.lax.ragged_dot_general(
            lhs, EXPERTS["e"], GROUPS, jax.lax.RaggedDotDimensionNumbers(
                (((1,), (1,)), ((), ())), (0,), (0,))),
        "conv": lambda: jax.lax.conv(img, ker, (1, 1), "SAME"),
        "conv_general_dilated": lambda: jax.lax.conv_general_dilated(img, ker, (1, 1), "SAME"),
        "conv_general_dilated_local": lambda: jax.lax.conv_general_dilated_local(
            img, jnp.ones((1, 9, 4, 8), jnp.float32), (1, 1), "SAME", (3, 3)),
        "conv_general_dilated_patches": lambda: jax.lax.conv_general_dilated_patches(
            img, (3, 3), (1, 1), "SAME"),
        "conv_with_general_padding": lambda: jax.lax.conv_with_general_padding(
            img, ker, (1, 1), ((1, 1), (1, 1)), None, None),
        "conv_transpose": lambda: jax.lax.conv_transpose(img, ker, (1, 1), "SAME",
                                                         dimension_numbers=("NCHW", "OIHW",
                                                                            "NCHW")),
        "scaled_dot": lambda: jax.lax.scaled_dot(
            lhs.astype(jnp.float8_e4m3fn), rhs.T.astype(jnp.float8_e4m3fn),
            lhs_scale=jnp.ones((4, 1), jnp.float8_e8m0fnu),
            rhs_scale=jnp.ones((8, 1), jnp.float8_e8m0fnu),
            dimension_numbers=(((1,), (1,)), ((), ())), preferred_element_type=jnp.float32),
    }


# jax.lax names that say dot/matmul/conv but compute no matmul (types, shapes, casts).
_NOT_MATMULS = {
    "ConvDimensionNumbers", "ConvGeneralDilatedDimensionNumbers", "DotAlgorithm",
    "DotAlgorithmPreset", "DotDimensionNumbers", "RaggedDotDimensionNumbers",
    "bitcast_convert_type", "bitcast_convert_type_p", "conv_dimension_numbers",
    "conv_general_dilated_p", "conv_general_permutations", "conv_general_shape_tuple",
    "conv_shape_tuple", "conv_transpose_shape_tuple", "convert_element_type",
    "convert_element_type_p", "dot_general_p",
}
# Primitives that move or cast data around a matmul (no FLOPs of their own worth counting).
_PLUMBING = {"convert_element_type", "broadcast_in_dim", "reshape", "transpose", "squeeze",
             "expand_dims", "pjit", "jit", "iota", "eq", "concatenate", "pad", "rev", "mul",
             "select_n", "slice", "copy", "add", "gather", "lt", "ge", "le", "gt", "and",
             "dynamic_slice", "sub", "clamp"}


def test_every_lax_matmul_primitive_is_counted_by_inspect_policy():
    """Every jax.lax function named like a matmul or convolution is known here (a new one
    fails the first assertion), and every primitive with FLOPs that one binds is a matmul
    the policy and inspect_policy count."""
    import re

    from fmtkit.policy import _ops

    names = {n for n in dir(jax.lax) if re.search("dot|matmul|conv|gemm|einsum", n, re.I)}
    calls = _lax_matmul_calls()
    assert names - _NOT_MATMULS == set(calls), names - _NOT_MATMULS ^ set(calls)
    for name, call in calls.items():
        prims = {e.primitive.name for e in iter_eqns(jax.make_jaxpr(call)())}
        assert prims - _PLUMBING and prims - _PLUMBING <= _ops.MATMUL_LIKE, (name, prims)


# ---------------------------------------------------------------------------------------------
# Forward-mode AD through a model with an output layer.

class _Classifier(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(3, name="head")(jnp.tanh(nn.Dense(8, name="hidden")(x)))


def _forward_mode(policied, variables):
    """jax.jvp, jax.jacfwd and a Hessian-vector product of the policied model."""
    def f(x):
        return policied.apply(variables, x)

    def loss(p):  # (a delayed recipe's amax histories kept as they are)
        return jnp.sum(policied.apply({**variables, "params": p}, X) ** 2)

    out, tangent = jax.jvp(f, (X,), (jnp.ones_like(X),))
    jac = jax.jacfwd(lambda x: jnp.sum(f(x)))(X)
    hvp = jax.jvp(jax.grad(loss), (variables["params"],), (variables["params"],))[1]
    return out, tangent, jac, hvp


def test_forward_mode_ad_through_a_policied_model_with_an_output_layer():
    model = _Classifier()
    variables = model.init(jax.random.key(0), X)
    exact = _forward_mode(with_policy(model, "fp32"), variables)
    want = _forward_mode(model, variables)
    for a, b in zip(jax.tree.leaves(exact), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    policied = with_policy(model, "bf16-mixed")
    got = _forward_mode(policied, variables)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):  # bf16 matmuls: 2**-6
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert np.linalg.norm(a - b) <= 2.0**-6 * np.linalg.norm(b)
    # The tangent's matmuls run on bf16 too: the head's (its tangent rule) and the hidden's.
    closed = jax.make_jaxpr(lambda x: jax.jvp(lambda y: policied.apply(variables, y), (x,),
                                              (x,)))(X)
    found = {(e.primitive.name, *operand_dtypes(e)) for e in iter_eqns(closed)
             if e.primitive.name in MATMULS}
    assert found == {("dot_general", BF16, BF16)}, found


def test_forward_mode_ad_negative_control():
    """Mutation: the head's matmul a custom_vjp again (the previous handling)."""
    model = _Classifier()
    variables = model.init(jax.random.key(0), X)
    with flipped(mixed_matmul_jvp=False), pytest.raises(TypeError, match="forward-mode"):
        _forward_mode(with_policy(model, "bf16-mixed"), variables)


_FP8_AD_TOLERANCE = {"fp8-current": 0.1, "fp8-delayed": 0.1, "fp8-blockwise": 0.1,
                     "nvfp4": 0.3}
"""Relative error (Frobenius) of each forward-mode result against the f32 model's: E4M3
rounds each operand by up to 2^-4 relative (RNE), E2M1 by up to 2^-2 (a tangent or an HVP
runs through the quantized hidden weights and activations, the head on bf16)."""


@pytest.mark.parametrize("preset", list(_FP8_AD_TOLERANCE))
def test_forward_mode_ad_under_fp8_and_fp4_presets(preset):
    """jax.jvp, jax.jacfwd and a Hessian-vector product (jvp of grad) run through the FP8 /
    FP4 GEMMs: finite, within the recipe's quantization error of the f32 model's, and the
    jvp's jaxpr computes the hidden layer's tangent with the FP8 GEMM's tangent primitive
    (not a mixed-precision fallback)."""
    from fmtkit._lowp import autodiff

    model = _Classifier()
    policied = with_policy(model, preset)
    variables = policied.init(jax.random.key(0), X)
    want = _forward_mode(model, {"params": variables["params"]})
    got = _forward_mode(policied, variables)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert np.all(np.isfinite(a))
        assert np.linalg.norm(a - b) <= _FP8_AD_TOLERANCE[preset] * np.linalg.norm(b)
    closed = jax.make_jaxpr(lambda x: jax.jvp(lambda y: policied.apply(variables, y), (x,),
                                              (x,)))(X)
    prims = [e.primitive.name for e in iter_eqns(closed)]
    assert prims.count(autodiff.TANGENT_PRIMITIVE) == 1, prims  # the hidden layer (the head: bf16)


# ---------------------------------------------------------------------------------------------
# The output layer found whatever order the loss terms are written in.

TEACHER = {"w": jnp.asarray(RNG.standard_normal((8, 16)) / 3, jnp.float32),
           "o": jnp.asarray(RNG.standard_normal((16, 3)) / 4, jnp.float32)}
LABELS = jnp.array([0, 1, 2, 0], jnp.int32)


def _mlp(p, x):
    return jnp.tanh(x @ p["w"]) @ p["o"]


def _kl(s, t):
    pt = jax.nn.softmax(t)
    return (jnp.mean(jnp.sum(pt * jax.nn.log_softmax(t), -1))
            - jnp.mean(jnp.sum(pt * jax.nn.log_softmax(s), -1)))


def _ce(s, y):
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(s), y[:, None], 1))


def distill_kl_first(params, x, y):
    s = _mlp(params["student"], x)
    t = jax.lax.stop_gradient(_mlp(params["teacher"], x))
    return 0.5 * _kl(s, t) + _ce(s, y)


def distill_ce_first(params, x, y):
    s = _mlp(params["student"], x)
    t = jax.lax.stop_gradient(_mlp(params["teacher"], x))
    return _ce(s, y) + 0.5 * _kl(s, t)


DISTILL_PARAMS = {"student": PARAMS, "teacher": TEACHER}


def _head_results(closed):
    """Result dtype of the student's head matmul (rhs [8, 3]) and the teacher's ([16, 3])."""
    return {e.invars[1].aval.shape: e.outvars[0].aval.dtype for e in iter_eqns(closed)
            if e.primitive.name == "dot_general" and e.invars[1].aval.shape[-1:] == (3,)}


@pytest.mark.parametrize("loss", [distill_kl_first, distill_ce_first])
def test_distillation_finds_the_student_head_in_either_order(loss):
    _assert_fp32_identity(loss, DISTILL_PARAMS, X, LABELS)
    closed = jax.make_jaxpr(with_policy(loss, "bf16-mixed"))(DISTILL_PARAMS, X, LABELS)
    assert _head_results(closed) == {(8, 3): F32, (16, 3): BF16}


def test_distillation_negative_control():
    """Mutation: stop_gradient keeps the teacher's head: the KL term, first, wins."""
    with flipped(stop_gradient_ends_head=False), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the two heads are then ambiguous
        closed = jax.make_jaxpr(with_policy(distill_kl_first, "bf16-mixed"))(
            DISTILL_PARAMS, X, LABELS)
    assert _head_results(closed)[(8, 3)] == BF16


def _two_trained_heads(params, x, y):
    s, t = _mlp(params["student"], x), _mlp(params["teacher"], x)
    return _kl(s, t) + _ce(s, y)


def test_ambiguous_heads_warn_naming_mark_head():
    with pytest.warns(UserWarning, match="different output layers.*mark_head"):
        jax.make_jaxpr(with_policy(_two_trained_heads, "bf16-mixed"))(
            DISTILL_PARAMS, X, LABELS)

    def marked(params, x, y):
        from fmtkit.policy import mark_head

        s = mark_head(_mlp(params["student"], x))
        return _kl(s, _mlp(params["teacher"], x)) + _ce(s, y)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        closed = jax.make_jaxpr(with_policy(marked, "bf16-mixed"))(DISTILL_PARAMS, X, LABELS)
    assert _head_results(closed) == {(8, 3): F32, (16, 3): BF16}


# ---------------------------------------------------------------------------------------------
# No crash on any construct, under one preset of each family.

NO_CRASH = {
    "custom_vjp": (vjp_model, (PARAMS, X)), "custom_jvp": (jvp_model, (PARAMS, X)),
    "nested_policy": (nested_model, (PARAMS, X)), "fft": (fft_model, (PARAMS, X)),
    "eigh": (eigh_model, (PARAMS, X)), "linalg": (linalg_model, (PARAMS, X)),
    "callback": (callback_model, (PARAMS, X)),
    "preferred_element_type": (wide_result_model, (PARAMS, X)),
    "precision_highest": (_highest_model, (PARAMS, X)),
    "dot_algorithm": (_algorithm_model, (PARAMS, X)),
    "dot_product_attention": (_attention, (PARAMS, Q)), "ragged_dot": (moe_model, (EXPERTS, X)),
    "distillation": (distill_kl_first, (DISTILL_PARAMS, X, LABELS)),
}


@pytest.mark.parametrize("preset", ["bf16-mixed", "fp8-current", "nvfp4"])
@pytest.mark.parametrize("name", sorted(NO_CRASH))
def test_no_crash_on_any_construct(name, preset):
    model, args = NO_CRASH[name]
    policied = with_policy(model, preset)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        value, grads = jax.value_and_grad(lambda *a: jnp.sum(policied(*a)))(*args)
    assert all(issubclass(w.category, UserWarning) for w in caught), caught
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(grads))
    assert bool(jnp.isfinite(value))


# ---------------------------------------------------------------------------------------------
# inspect_policy counts what the program runs, labelled as it runs.

class _Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        return jnp.tanh(nn.Dense(8, name="dense")(x))


class _Remat(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(3, name="head")(nn.remat(_Block)(name="block")(x))


def test_rematerialized_forward_matmuls_are_labelled_forward():
    model = _Remat()
    variables = model.init(jax.random.key(0), X)
    report = inspect_policy(with_policy(model, "bf16-mixed"), X, variables=variables)
    block = sorted(m.kind for m in report.matmul_ops if m.path == "block/dense")
    # forward, its recomputation on the backward pass, wgrad (x is data: no dgrad)
    assert block == ["forward", "forward", "wgrad"], block


def test_rematerialized_forward_negative_control():
    model = _Remat()
    variables = model.init(jax.random.key(0), X)
    with flipped(remat_forward_kind=False):
        report = inspect_policy(with_policy(model, "bf16-mixed"), X, variables=variables)
    assert sorted(m.kind for m in report.matmul_ops if m.path == "block/dense") != [
        "forward", "forward", "wgrad"]


def test_the_head_runs_one_forward_one_dgrad_one_wgrad():
    """No dead copy of the head's matmuls in the gradient's jaxpr (what inspect_policy
    counts): the hidden layer's forward and wgrad (x is data), the head's three."""
    model = _Classifier()
    variables = model.init(jax.random.key(0), X)
    policied = with_policy(model, "bf16-mixed")
    closed = jax.make_jaxpr(jax.grad(lambda v: jnp.sum(policied.apply(v, X))))(variables)
    shapes = [tuple(v.aval.shape for v in e.invars[:2]) for e in iter_eqns(closed)
              if e.primitive.name == "dot_general"]
    assert len(shapes) == 5, shapes
    report = inspect_policy(policied, X, variables=variables)
    assert sorted((m.path, m.kind) for m in report.matmul_ops) == [
        ("head", "dgrad"), ("head", "forward"), ("head", "wgrad"),
        ("hidden", "forward"), ("hidden", "wgrad")]


# ---------------------------------------------------------------------------------------------
# One-hot embedding lookups (T5X's Embed(one_hot=True)) stay out of FP8.

VOCAB = 16
EMBED = {"emb": jnp.asarray(RNG.standard_normal((VOCAB, 8)), jnp.float32),
         "w": PARAMS["w"], "o": PARAMS["o"]}
IDS = jnp.array([1, 2, 3, 15], jnp.int32)


def onehot_model(params, ids):
    x = jax.nn.one_hot(ids, VOCAB) @ params["emb"]
    return jnp.tanh(x @ params["w"]) @ params["o"]


def _lookup_dtypes(closed):
    return [operand_dtypes(e) for e in iter_eqns(closed) if e.primitive.name == "dot_general"
            and e.invars[0].aval.shape[-1:] == (VOCAB,)]


def test_one_hot_embedding_lookup_stays_out_of_fp8():
    _assert_fp32_identity(onehot_model, EMBED, IDS)
    closed = jax.make_jaxpr(with_policy(onehot_model, "fp8-current"))(EMBED, IDS)
    assert _lookup_dtypes(closed) == [(BF16, BF16)]
    found = [operand_dtypes(e) for e in iter_eqns(closed) if e.primitive.name == "dot_general"]
    assert (jnp.dtype(jnp.float8_e4m3fn),) * 2 in found  # x @ w is still FP8
    # the looked-up rows are the bf16 rows, exactly
    rows = with_policy(lambda p, i: jax.nn.one_hot(i, VOCAB) @ p["emb"], "fp8-current")(
        EMBED, IDS)
    np.testing.assert_array_equal(np.asarray(rows, np.float32),
                                  np.asarray(EMBED["emb"][IDS].astype(BF16), np.float32))


def test_one_hot_embedding_negative_control():
    with flipped(onehot_lookups=False):
        closed = jax.make_jaxpr(with_policy(onehot_model, "fp8-current"))(EMBED, IDS)
    assert _lookup_dtypes(closed) != [(BF16, BF16)]


# ---------------------------------------------------------------------------------------------
# JAX's explicit-sharding meshes (4 simulated devices, in a subprocess).

_EXPLICIT_MESH_SCRIPT = r'''
import json, os
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")  # tests/child_env.py's
                           + " --xla_force_host_platform_device_count=4")
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
from fmtkit.policy import with_policy

mesh = jax.make_mesh((4,), ("data",), axis_types=(AxisType.Explicit,))

def model(p, x):
    return jnp.tanh(x @ p["w"]) @ p["o"]

out = {}
with jax.set_mesh(mesh):
    x = jax.device_put(jnp.arange(64.0).reshape(8, 8) / 64, NamedSharding(mesh, P("data")))
    p = jax.device_put({"w": jnp.eye(8) / 2, "o": jnp.ones((8, 3)) / 3},
                       NamedSharding(mesh, P()))
    for preset in ("fp32", "bf16-mixed"):
        f = with_policy(model, preset)
        vg = jax.jit(jax.value_and_grad(lambda p, x: jnp.sum(f(p, x))))
        closed = jax.make_jaxpr(vg)(p, x)
        dots = []
        def walk(j):
            for e in j.eqns:
                if e.primitive.name == "dot_general":
                    dots.append(str(e.invars[0].aval.dtype))
                for sub in jax.extend.core.jaxprs_in_params(e.params):
                    walk(getattr(sub, "jaxpr", sub))
        walk(closed.jaxpr)
        value, grads = vg(p, x)
        ref = jax.jit(jax.value_and_grad(lambda p, x: jnp.sum(model(p, x))))(p, x)
        out[preset] = {
            "spec": str(jax.jit(f)(p, x).sharding.spec), "dots": sorted(set(dots)),
            "exact": bool(np.array_equal(np.asarray(value), np.asarray(ref[0])) and all(
                np.array_equal(np.asarray(a), np.asarray(b))
                for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref[1]))))}
print(json.dumps(out))
'''


def test_explicit_sharding_mesh_under_mixed_presets():
    import json
    import subprocess
    import sys

    env = child_env()
    done = subprocess.run([sys.executable, "-c", _EXPLICIT_MESH_SCRIPT], capture_output=True,
                          text=True, env=env, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["fp32"] == {"spec": "P('data', None)", "dots": ["float32"],
                           "exact": True}, out
    assert out["bf16-mixed"]["spec"] == "P('data', None)", out
    assert out["bf16-mixed"]["dots"] == ["bfloat16"], out


_EXPLICIT_MESH_FP8_SCRIPT = r'''
import json, os
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")  # tests/child_env.py's
                           + " --xla_force_host_platform_device_count=4"
                           " --xla_allow_excess_precision=false")  # (as tests/conftest.py)
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
from fmtkit.policy import with_policy

mesh = jax.make_mesh((4,), ("data",), axis_types=(AxisType.Explicit,))
rng = np.random.default_rng(0)
X = rng.standard_normal((16, 256)).astype(np.float32)
PARAMS = {"w": (rng.standard_normal((256, 128)) / 16).astype(np.float32),
          "o": (rng.standard_normal((128, 3)) / 8).astype(np.float32)}

def model(p, x):
    return jnp.tanh(x @ p["w"]) @ p["o"]

def run(preset, p, x):
    f = with_policy(model, preset)
    value, grads = jax.jit(jax.value_and_grad(lambda p, x: jnp.sum(f(p, x) ** 2)))(p, x)
    return jax.jit(f)(p, x), value, grads

def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))

out = {}
for preset in ("fp8-current", "fp8-blockwise"):
    y0, v0, g0 = run(preset, PARAMS, X)  # no mesh
    ymix = run("bf16-mixed", PARAMS, X)[0]
    with jax.set_mesh(mesh):
        x = jax.device_put(X, NamedSharding(mesh, P("data")))
        p = jax.device_put(PARAMS, NamedSharding(mesh, P()))
        y, v, g = run(preset, p, x)
    out[preset] = {
        "y_spec": str(y.sharding.spec),
        "grad_specs": {k: str(a.sharding.spec) for k, a in g.items()},
        "exact": [bool(np.array_equal(np.asarray(a), np.asarray(b)))
                  for a, b in ((y, y0), (v, v0), (g["w"], g0["w"]))],
        "fp8": bool(not np.array_equal(np.asarray(y0), np.asarray(ymix))),
        "head_grad_rel": rel(g["o"], g0["o"])}
print(json.dumps(out))
'''


def test_explicit_sharding_mesh_under_fp8_presets():
    """FP8 presets on an explicit mesh (tokens sharded over 4 devices, weights replicated):
    no ShardingTypeError; y keeps the traced sharding; the gradients get their parameters'
    (replicated); output, loss and the FP8 layer's weight gradient equal the unsharded
    run's bit for bit (the forward GEMM contracts K, unsharded; the FP8 wgrad sums f32
    partials over the token shards, exactly here). The bf16 head's weight gradient (not FP8)
    sums bf16 partials per shard: within 2^-7 of the unsharded one. Runs FP8 (y differs from
    bf16-mixed's)."""
    import json
    import subprocess
    import sys

    env = child_env(fast_compile=False)  # bit-identical sums over shards: tests/child_env.py
    done = subprocess.run([sys.executable, "-c", _EXPLICIT_MESH_FP8_SCRIPT],
                          capture_output=True, text=True, env=env, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    for preset, got in out.items():
        assert got["y_spec"] == "P('data', None)", (preset, got)
        assert got["grad_specs"] == {"o": "P(None, None)", "w": "P(None, None)"}, got
        assert got["exact"] == [True, True, True], (preset, got)
        assert got["fp8"], (preset, got)
        assert got["head_grad_rel"] <= 2.0**-7, (preset, got)


# ---------------------------------------------------------------------------------------------
# Complex matmuls (S5-style state-space models) run as traced, and say so.

COMPLEX = {"w": jnp.asarray(RNG.standard_normal((8, 8)) + 1j * RNG.standard_normal((8, 8)),
                            jnp.complex64) / 8, "o": PARAMS["o"]}


def complex_model(params, x):
    return jnp.real(x.astype(jnp.complex64) @ params["w"]) @ params["o"]


@pytest.mark.parametrize("preset", ["bf16-mixed", "fp8-current", "nvfp4"])
def test_complex_matmuls_run_as_traced_with_a_warning(preset):
    _assert_fp32_identity(complex_model, COMPLEX, X)
    with pytest.warns(UserWarning, match="complex matmul in module '<root>' runs in its "
                                         "traced dtype"):
        closed = _grad_jaxpr(with_policy(complex_model, preset), COMPLEX, X)
    c64 = jnp.dtype(jnp.complex64)
    assert [m for m in _matmuls(closed) if c64 in m] == [("dot_general", c64, c64)] * 2


def test_complex_matmuls_negative_control():
    with flipped(complex_as_traced=False), pytest.raises(TypeError, match="complex64"):
        _grad_jaxpr(with_policy(complex_model, "fp8-current"), COMPLEX, X)


# ---------------------------------------------------------------------------------------------
# Convolutions under FP8 presets: on the compute dtype, and the report says so.

class _ConvNet(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.Conv(8, (3, 3), name="conv")(x))
        h = nn.relu(nn.Dense(16, name="hidden")(h.reshape(h.shape[0], -1)))
        return nn.Dense(3, name="head")(h)


# The run-time warning about these convolutions is tested in test_conv_fp8_warning.py.
@pytest.mark.filterwarnings("ignore:Convolutions in module:UserWarning")
def test_convolutions_under_fp8_are_not_counted_by_fp8_fraction():
    """Under fp8-current the conv runs bf16 x bf16 and the hidden Dense FP8 (read from the
    jaxpr by the independent walker); fp8_fraction covers the FP8 recipe's targets only
    (the hidden Dense: 1.0, where the conv's FLOPs would make it 0.25 here), and the
    report's text names the convolutions' FLOPs and dtypes as not targeted."""
    model = _ConvNet()
    x = jnp.asarray(RNG.standard_normal((2, 6, 6, 3)), jnp.float32)
    policied = with_policy(model, "fp8-current")
    variables = policied.init(jax.random.key(0), x)
    closed = jax.make_jaxpr(lambda v: policied.apply(v, x))(variables)
    convs = [operand_dtypes(e) for e in iter_eqns(closed)
             if e.primitive.name == "conv_general_dilated"]
    assert convs == [(BF16, BF16)]
    fp8_dots = [e for e in iter_eqns(closed) if e.primitive.name == "dot_general"
                and "float8" in str(e.source_info.name_stack)]
    assert fp8_dots  # the hidden Dense's FP8 GEMM (widened off GPUs, in its named scope)
    report = inspect_policy(policied, x, variables=variables)
    conv_flops = sum(m.flops for m in report.matmul_ops
                     if m.primitive == "conv_general_dilated" and m.kind == "forward")
    dense_flops = sum(m.flops for m in report.matmul_ops if m.path == "hidden"
                      and m.kind == "forward")
    assert conv_flops == 2 * 2 * 6 * 6 * 8 * 3 * 3 * 3 and dense_flops == 2 * 2 * 288 * 16
    for kind in ("forward", "dgrad", "wgrad"):
        assert report.fp8_fraction(kind) == 1.0, kind
    assert "convolutions: " in str(report) and "not targeted by the FP8 recipes" in str(report)


# ---------------------------------------------------------------------------------------------
# Matmuls through a detached Module.apply (a tied output head) are placed under their caller.

class _TiedLM(nn.Module):
    @nn.compact
    def __call__(self, ids):
        emb = self.param("embedding", nn.initializers.normal(1.0), (11, 8))
        h = nn.Dense(8, name="body")(jnp.take(emb, ids, axis=0))
        return nn.Dense(11, use_bias=False, name="lm_head").apply(
            {"params": {"kernel": emb.T}}, h)


def test_detached_apply_gets_the_callers_path():
    """The tied head's Dense, run by its own ``apply`` inside the model, is reported at
    ``lm_head`` (not the root ``""``), and a rule for that path reaches it: its matmul then
    computes f32 x f32 under bf16-mixed (read from the jaxpr)."""
    ids = jnp.array([[1, 2, 3], [4, 5, 6]], jnp.int32)
    model = _TiedLM()
    variables = model.init(jax.random.key(0), ids)
    report = inspect_policy(with_policy(model, "bf16-mixed"), ids, variables=variables)
    fwd = {m.path for m in report.matmul_ops if m.kind == "forward"}
    assert fwd == {"body", "lm_head"}, fwd
    rule = "p=f32,c=f32,o=f32"
    import dataclasses

    from fmtkit.policy import get_preset
    preset = get_preset("bf16-mixed")
    rules = dataclasses.replace(preset, rules=[("^lm_head$", rule), *preset.rules])
    policied = with_policy(model, rules)
    closed = jax.make_jaxpr(lambda v: policied.apply(v, ids))(variables)
    dots = [operand_dtypes(e) for e in iter_eqns(closed) if e.primitive.name == "dot_general"]
    assert (F32, F32) in dots and (BF16, BF16) in dots, dots
