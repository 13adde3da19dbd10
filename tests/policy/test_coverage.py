"""Coverage: a matmul hidden in any primitive that holds a body runs under the policy.

Each construct (cond, switch, while / fori_loop with a traced bound, shard_map, a user's
custom_vjp, a nested jit with out_shardings) holds one projection ``a @ w`` (w: [8, 8]) before
a head ``h @ o`` (o: [8, 3]). Dtypes are read from the jaxpr of the gradient (the forward
pass for while, which JAX cannot differentiate) with ``jaxpr_utils``, a walker that knows
nothing of the policy; the report (``inspect_policy``) is checked against the same walker.
"""

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from child_env import child_env
from jax import lax
from jax.experimental import pallas as pl
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from jaxpr_utils import iter_eqns, matmul_flops, operand_dtypes

from fmtkit.policy import inspect_policy, with_policy

BF16, F32 = jnp.dtype("bfloat16"), jnp.dtype("float32")
MATMULS = ("dot_general", "conv_general_dilated")
RNG = np.random.default_rng(0)
X = jnp.asarray(RNG.standard_normal((4, 8)), jnp.float32)
PARAMS = {"w": jnp.asarray(RNG.standard_normal((8, 8)) / 3, jnp.float32),
          "o": jnp.asarray(RNG.standard_normal((8, 3)), jnp.float32)}
MESH = jax.make_mesh((1,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
OUT_SHARDING = NamedSharding(MESH, P())


@jax.custom_vjp
def _user_matmul(a, w):
    return a @ w


def _user_fwd(a, w):
    return a @ w, (a, w)


def _user_bwd(res, g):
    a, w = res
    return g @ w.T, jnp.einsum("...i,...j->ij", a, g)


_user_matmul.defvjp(_user_fwd, _user_bwd)


def _construct(name):
    """``body(w, x, n)``: ``x @ w`` inside the construct ``name`` (n: a traced int)."""
    def cond(w, x, n):
        return lax.cond(n > 0, lambda a: jnp.tanh(a @ w), lambda a: a @ w, x)

    def switch(w, x, n):
        return lax.switch(n, [lambda a: a, lambda a: a @ w, lambda a: jnp.tanh(a) @ w], x)

    def fori(w, x, n):
        return lax.fori_loop(0, n, lambda i, a: jnp.tanh(a @ w), x)

    def shard_map(w, x, n):
        return jax.shard_map(lambda a, b: a @ b, mesh=MESH, in_specs=(P("d"), P()),
                             out_specs=P("d"))(x, w)

    def custom_vjp(w, x, n):
        return _user_matmul(x, w)

    def jit(w, x, n):
        return jax.jit(lambda a, b: jnp.tanh(a @ b), out_shardings=OUT_SHARDING)(x, w)

    return locals()[name]


CONSTRUCTS = ("cond", "switch", "fori", "shard_map", "custom_vjp", "jit")


def _model(name):
    body = _construct(name)

    def model(params, x, n):
        return body(params["w"], x, n) @ params["o"]

    return model


def _loss(model):
    return lambda params, x, n: jnp.sum(model(params, x, n))


def _matmuls(closed):
    """(primitive, lhs dtype, rhs dtype, lhs shape, rhs shape) of every matmul, sub-jaxprs
    included."""
    return [(e.primitive.name, *operand_dtypes(e),
             e.invars[0].aval.shape, e.invars[1].aval.shape)
            for e in iter_eqns(closed) if e.primitive.name in MATMULS]


def _is_head(m):
    return 3 in m[3] or 3 in m[4]  # the head's 3 outputs appear in no other matmul


def _traced(name, preset):
    """The jaxpr a user would run: the gradient (forward only for a while loop)."""
    fn = with_policy(_loss(_model(name)), preset)
    n = jnp.int32(2 if name == "switch" else 1)
    if name == "fori":  # JAX cannot differentiate a while loop with a traced bound
        return jax.make_jaxpr(fn)(PARAMS, X, n)
    return jax.make_jaxpr(jax.grad(fn))(PARAMS, X, n)


@pytest.mark.parametrize("name", CONSTRUCTS)
def test_matmul_inside_construct_bf16(name):
    found = [m for m in _matmuls(_traced(name, "bf16-mixed")) if not _is_head(m)]
    if name == "custom_vjp":
        # The forward rule is interpreted, and so is the user's backward rule (traced on the
        # residuals and cotangents): its dgrad and wgrad run on the compute dtype too.
        forward, backward = found[0], found[1:]
        assert forward[1:] == (BF16, BF16, (4, 8), (8, 8)), found
        assert len(backward) == 2, found
    assert found, "the construct's matmul is missing"
    assert all(m[1:3] == (BF16, BF16) for m in found), found


@pytest.mark.parametrize("name", CONSTRUCTS)
def test_matmul_inside_construct_fp8(name):
    found = [m for m in _matmuls(_traced(name, "fp8-current")) if not _is_head(m)]
    if name == "custom_vjp":
        found = [m for m in found if m[3] == (4, 8) and m[4] == (8, 8)][:1]
    assert found
    for m in found:
        assert all(jnp.dtype(d).itemsize == 1 and jnp.issubdtype(d, jnp.floating)
                   for d in m[1:3]), (name, found)


def test_nested_jit_keeps_its_out_shardings():
    closed = jax.make_jaxpr(with_policy(_model("jit"), "bf16-mixed"))(PARAMS, X, jnp.int32(1))
    jits = [e for e in iter_eqns(closed) if e.primitive.name in ("jit", "pjit")]
    assert [tuple(e.params["out_shardings"]) for e in jits] == [(OUT_SHARDING,)]


def test_fori_loop_value_matches_hand_cast_reference():
    """The loop carry keeps its traced dtype (f32); the matmul in the body is bf16."""
    def model(params, x, n):
        return lax.fori_loop(0, n, lambda i, a: jnp.tanh(a @ params["w"]), x) @ params["o"]

    def reference(params, x, n):  # the head: bf16 operands, f32 logits
        w, o = params["w"].astype(BF16), params["o"].astype(BF16)
        h = lax.fori_loop(0, n, lambda i, a: jnp.tanh(
            lax.dot(a.astype(BF16), w, preferred_element_type=BF16)).astype(F32), x)
        return lax.dot(h.astype(BF16), o, preferred_element_type=F32)

    got = jax.jit(with_policy(model, "bf16-mixed"))(PARAMS, X, jnp.int32(3))
    want = jax.jit(reference)(PARAMS, X, jnp.int32(3))
    assert got.dtype == F32
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_switch_outputs_share_one_dtype():
    """Branch outputs of different dtypes (identity f32, matmul bf16) meet in the widest."""
    fn = with_policy(_model("switch"), "bf16-mixed")
    for n in range(3):
        got = fn(PARAMS, X, jnp.int32(n))
        want = _model("switch")(PARAMS, X, jnp.int32(n))
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0.05, atol=0.05)


def _kernel(x_ref, w_ref, o_ref):
    o_ref[...] = jnp.dot(x_ref[...], w_ref[...])


def _pallas_model(params, x):
    call = pl.pallas_call(_kernel, out_shape=jax.ShapeDtypeStruct((4, 8), jnp.float32),
                          interpret=True)
    return call(call(x, params["w"]), params["w"]) @ params["o"]


def test_opaque_body_warns_once_and_is_reported():
    with pytest.warns(UserWarning, match="'pallas_call' in module '<root>'") as record:
        report = inspect_policy(with_policy(_pallas_model, "bf16-mixed"), PARAMS, X,
                                backward=False)
    assert sum("pallas_call" in str(w.message) for w in record) == 1
    assert report.opaque == (("", "pallas_call"),)
    flagged = report.unpolicied()
    assert [m.reason for m in flagged] == ["opaque pallas_call"] * 2
    assert all(m.dtypes == "float32 x float32 -> float32" for m in flagged)
    # 2 x 4 x 8 x 8 per kernel matmul; the head 2 x 4 x 3 x 8 ran under the policy.
    assert report.policied_fraction() == pytest.approx(192 / (192 + 2 * 512))


# ---------------------------------------------------------------------------------------------
# inspect_policy: every FLOP accounted for, and the inputs real models take.


def test_report_counts_every_matmul_flop_as_the_jaxpr_does():
    def model(params, x, n):
        h = lax.cond(n > 0, lambda a: a @ params["w"], lambda a: a, x)
        return _user_matmul(h, params["w"]) @ params["o"]

    report = inspect_policy(with_policy(model, "bf16-mixed"), PARAMS, X, jnp.int32(1),
                            argnums=0)
    closed = jax.make_jaxpr(jax.grad(_loss(with_policy(model, "bf16-mixed"))))(
        PARAMS, X, jnp.int32(1))
    flops = [matmul_flops(e) for e in iter_eqns(closed) if e.primitive.name in MATMULS]
    assert sum(m.flops for m in report.matmul_ops) == sum(flops)
    # The user's custom_vjp backward (dgrad + wgrad of one 4x8x8 matmul) is interpreted too.
    assert report.unpolicied() == []
    assert report.policied_fraction() == 1.0
    assert list(report.params) == ["0/o", "0/w"]  # argnums=0: x is not differentiated


def test_report_integer_tokens_and_prng_key_inputs():
    def lm(params, tokens, key, train):
        h = params["emb"][tokens]
        if train:
            h = h + 0.1 * jax.random.normal(key, h.shape)
        return (h @ params["w"]) @ params["emb"].T

    params = {"emb": jnp.asarray(RNG.standard_normal((11, 8)), jnp.float32),
              "w": PARAMS["w"]}
    tokens = jnp.asarray(RNG.integers(0, 11, (2, 5)), jnp.int32)
    report = inspect_policy(with_policy(lm, "bf16-mixed"), params, tokens,
                            jax.random.key(0), True)  # a positional Python bool: static
    assert list(report.params) == ["0/emb", "0/w"]
    assert report.policied_fraction() == 1.0
    assert {m.dtypes.split(" -> ")[0] for m in report.matmul_ops} == {
        "bfloat16 x bfloat16"}
    assert {m.kind for m in report.matmul_ops} == {"forward", "dgrad", "wgrad"}


def test_report_forward_only_generate_loop():
    """A generate-style while loop (traced length) cannot be differentiated: backward=False."""
    def generate(params, x, steps):
        def body(i, carry):
            h, out = carry
            h = jnp.tanh(h @ params["w"])
            return h, out.at[i].set(h @ params["o"])
        return lax.fori_loop(0, steps, body, (x, jnp.zeros((3, 4, 3), jnp.float32)))[1]

    report = inspect_policy(with_policy(generate, "fp8-current"), PARAMS, X, jnp.int32(3),
                            backward=False)
    assert report.policied_fraction() == 1.0
    assert {m.kind for m in report.matmul_ops} == {"forward"}
    fp8 = [m for m in report.matmul_ops if not m.head]
    assert fp8 and all(m.dtypes.startswith("float8_e4m3fn x float8_e4m3fn") for m in fp8)
    # The logits written into the returned buffer are the head, found through the loop.
    assert [m.dtypes for m in report.matmul_ops if m.head] == [
        "bfloat16 x bfloat16 -> float32"]
    assert set(report.params.values()) == {("float32", "-")}


class Noisy(nn.Module):
    """Needs an RNG stream other than "dropout", and a positional bool."""

    @nn.compact
    def __call__(self, x, train):
        h = nn.Dense(8)(x)
        if train:
            h = h + jax.random.normal(self.make_rng("noise"), h.shape)
        return nn.Dense(3)(h)


def test_report_linen_rngs_and_positional_bool():
    report = inspect_policy(with_policy(Noisy(), "bf16-mixed"), X, True,
                            rngs={"noise": jax.random.key(3)})
    assert report.policied_fraction() == 1.0
    assert report.modules["Dense_0"].matmuls["forward"] == ("bfloat16 x bfloat16 -> bfloat16",)
    with pytest.raises(TypeError, match="rngs is for linen"):
        inspect_policy(with_policy(lm_plain, "bf16-mixed"), PARAMS, X, rngs={})
    variables = Noisy().init({"params": jax.random.key(0), "noise": jax.random.key(1)}, X,
                             False)
    with pytest.raises(TypeError, match="variables=variables"):  # apply's argument order
        inspect_policy(with_policy(Noisy(), "bf16-mixed"), variables, X, False)
    with pytest.raises(TypeError, match="argnums must be ints"):
        inspect_policy(with_policy(lm_plain, "bf16-mixed"), PARAMS, X, argnums=5)


def lm_plain(params, x):
    return x @ params["w"]


def test_unwrapped_model_is_reported_as_not_policied():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # an empty Rules() matches nothing, by design
        report = inspect_policy(lm_plain, PARAMS, X)
    assert report.policied_fraction() == 0.0
    assert {m.reason for m in report.matmul_ops} == {"no rule"}


# ---------------------------------------------------------------------------------------------
# "fp32" is the unwrapped model, bit for bit, inner jit bodies and control flow included.


@jax.jit
def _attention(q, k, v):
    s = jnp.einsum("bqd,bkd->bqk", q, k) / np.float32(np.sqrt(q.shape[-1]))
    return jnp.einsum("bqk,bkd->bqd", jax.nn.softmax(s), v)


@jax.jit
def _rms(x, g):
    return x * lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * g[None, None]


class InnerJit(nn.Module):
    """Inner jax.jit bodies (attention, norm), a cond and a user's custom_vjp."""

    @nn.compact
    def __call__(self, x, flag):
        for i in range(2):
            h = _rms(x, self.param(f"g{i}", nn.initializers.ones, (x.shape[-1],)))
            q, k, v = (nn.Dense(16, name=f"{n}{i}")(h) for n in "qkv")
            x = x + _attention(q, k, v)
            w = self.param(f"w{i}", nn.initializers.lecun_normal(), (16, 16))
            x = x + lax.cond(flag > 0, lambda a, b: _user_matmul(jax.nn.gelu(a), b),
                             lambda a, b: a, x, w)
        return nn.Dense(10)(x)


def test_fp32_is_the_unwrapped_model_bit_for_bit():
    model = InnerJit()
    x = jnp.asarray(RNG.standard_normal((2, 8, 16)), jnp.float32)
    flag = jnp.int32(1)
    variables = model.init(jax.random.key(1), x, flag)

    def loss(apply):
        return lambda v: jnp.mean(jax.nn.log_softmax(apply(v, x, flag))[..., 0])

    want = jax.jit(jax.value_and_grad(loss(model.apply)))(variables)
    got = jax.jit(jax.value_and_grad(loss(with_policy(model, "fp32").apply)))(variables)
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("api, name", [("linen", "lm"), ("nnx", "moe")])
def test_report_share_is_one_on_reference_models(api, name):
    from policy_testlib import build

    case = build(api, name)
    report = inspect_policy(with_policy(case.model, "bf16-mixed"), *case.inputs,
                            loss_fn=case.loss_fn)
    assert report.matmul_ops and report.policied_fraction() == 1.0, report.unpolicied()
    assert {m.kind for m in report.matmul_ops} == {"forward", "dgrad", "wgrad"}


class Branchy(nn.Module):
    """linen's lifted ``nn.cond`` with a Dense in each branch; rules match inside them."""

    @nn.compact
    def __call__(self, x, flag):
        a, b = nn.Dense(8, name="keep"), nn.Dense(8, name="low")
        h = nn.cond(flag > 0, lambda mdl, v: a(v), lambda mdl, v: b(v), self, x)
        return nn.Dense(3, name="out")(jnp.tanh(h))


def test_linen_cond_branches_follow_module_rules():
    rules = [("keep", "p=f32,c=f32"), ("", "p=f32,c=bf16")]
    model = with_policy(Branchy(), rules)
    flag = jnp.int32(1)
    variables = model.init(jax.random.key(0), X, flag)
    closed = jax.make_jaxpr(jax.grad(
        lambda v: jnp.sum(model.apply(v, X, flag))))(variables)
    found = [m for m in _matmuls(closed) if not _is_head(m)]
    # Forward, dgrad and wgrad of each branch's Dense: "keep" in f32, "low" in bf16.
    assert {m[1:3] for m in found} == {(BF16, BF16), (F32, F32)}
    assert sum(m[1:3] == (BF16, BF16) for m in found) == sum(m[1:3] == (F32, F32)
                                                             for m in found)


_TWO_DEVICES = r'''
import json
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from jaxpr_utils import iter_eqns
from fmtkit.policy import with_policy

mesh = jax.make_mesh((2,), ("d",), axis_types=(jax.sharding.AxisType.Explicit,))

def model(p, x):
    h = jax.shard_map(lambda a, w: jax.lax.psum(jnp.tanh(a @ w), "d"), mesh=mesh,
                      in_specs=(P("d"), P()), out_specs=P())(x, p["w"])
    h = jax.jit(lambda a: a * 2, out_shardings=NamedSharding(mesh, P()))(h)
    return h @ p["o"]

rng = np.random.default_rng(0)
p = {"w": jnp.asarray(rng.standard_normal((8, 8)), jnp.float32),
     "o": jnp.asarray(rng.standard_normal((8, 3)), jnp.float32)}
x = jax.device_put(jnp.asarray(rng.standard_normal((4, 8)), jnp.float32),
                   NamedSharding(mesh, P("d")))
loss = lambda f: jax.jit(jax.value_and_grad(lambda p, x: jnp.sum(f(p, x))))
want, got = loss(model)(p, x), loss(with_policy(model, "fp32"))(p, x)
same = all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got)))
closed = jax.make_jaxpr(jax.grad(lambda p, x: jnp.sum(with_policy(model, "bf16-mixed")(p, x))))(
    p, x)
inside = [e for e in iter_eqns(closed) if e.primitive.name == "shard_map"]
dots = sorted({str(d.invars[0].aval.dtype) + "x" + str(d.invars[1].aval.dtype)
               for e in inside for d in iter_eqns(e.params["jaxpr"])
               if d.primitive.name == "dot_general"})
print(json.dumps({"fp32_same": same, "shard_map_dots": dots}))
'''


def test_shard_map_on_two_devices():
    """A real two-device mesh (a subprocess: the suite keeps one device): psum inside the
    body, a nested jit with out_shardings; "fp32" bit for bit, bf16 inside shard_map."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    tests = Path(__file__).resolve().parents[1]
    env = child_env("--xla_force_host_platform_device_count=2",
                    "--xla_allow_excess_precision=false", pythonpath=(tests.parent, tests))
    out = subprocess.run([sys.executable, "-c", _TWO_DEVICES], capture_output=True, text=True,
                         env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result == {"fp32_same": True, "shard_map_dots": ["bfloat16xbfloat16"]}


def test_report_nnx_positional_bool_and_integer_input():
    from flax import nnx

    class Tagged(nnx.Module):
        def __init__(self, rngs):
            self.emb = nnx.Embed(11, 8, rngs=rngs)
            self.lin = nnx.Linear(8, 3, rngs=rngs)

        def __call__(self, tokens, train):
            h = self.emb(tokens)
            return self.lin(jnp.tanh(h) if train else h)

    tokens = jnp.asarray(RNG.integers(0, 11, (2, 5)), jnp.int32)
    report = inspect_policy(with_policy(Tagged(nnx.Rngs(0)), "bf16-mixed"), tokens, True)
    assert report.policied_fraction() == 1.0
    assert report.modules["lin"].head["forward"] == ("bfloat16 x bfloat16 -> float32",)
