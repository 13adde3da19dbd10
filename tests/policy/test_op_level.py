"""The op-level mechanism itself: ops written anywhere, the head by role, author upcasts,
custom_jvp bodies, plain functions, jit caching, stacked delayed-FP8 state.

Dtypes are read from the jaxpr of the policied function (``jaxpr_utils``), never from the
policy's own report, except where the report is what is tested.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jaxpr_utils import iter_eqns, operand_dtypes

from fmtkit import fp8
from fmtkit.policy import Policy, Rules, inspect_policy, with_policy

BF16, F32 = jnp.dtype("bfloat16"), jnp.dtype("float32")
RNG = np.random.default_rng(0)
X = jnp.asarray(RNG.standard_normal((3, 5, 16)), jnp.float32)
TOKENS = jnp.asarray(RNG.integers(0, 50, (3, 5)), jnp.int32)


def _eqns(fn, *args, name=None):
    eqns = list(iter_eqns(jax.make_jaxpr(fn)(*args)))
    return [e for e in eqns if name is None or e.primitive.name == name]


def _out_dtypes(eqns):
    return {e.outvars[0].aval.dtype for e in eqns}


class HandWritten(nn.Module):
    """Attention and RMSNorm written by hand in one module's __call__ (no Flax layers but
    Dense), the way gemma writes them; softmax as max-subtract / exp / sum."""

    @nn.compact
    def __call__(self, x):
        var = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
        h = x * jax.lax.rsqrt(var + 1e-6) * self.param("scale", nn.initializers.ones, (16,))[
            None, None, :]
        q = nn.Dense(16, name="q")(h).reshape(3, 5, 2, 8)
        k = nn.Dense(16, name="k")(h).reshape(3, 5, 2, 8)
        s = jnp.einsum("bthd,bshd->bhts", q, k) / jnp.sqrt(8.0)
        s = s - jax.lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True))
        p = jnp.exp(s) / jnp.sum(jnp.exp(s), axis=-1, keepdims=True)
        o = jnp.einsum("bhts,bshd->bthd", p, k).reshape(3, 5, 16)
        return nn.Dense(16, name="proj")(x + o)


def test_hand_written_softmax_and_norm_run_in_f32_and_matmuls_in_bf16():
    model = with_policy(HandWritten(), "bf16-mixed")
    variables = model.init(jax.random.key(0), X)

    def loss(p):
        return jnp.sum(model.apply({"params": p}, X) ** 2)

    eqns = _eqns(jax.value_and_grad(loss), variables["params"])
    assert _out_dtypes([e for e in eqns if e.primitive.name in ("exp", "rsqrt", "log")]) == {F32}
    sums = [e for e in eqns if e.primitive.name in ("reduce_sum", "reduce_max")]
    assert sums and _out_dtypes(sums[:4]) == {F32}  # the forward pass's norm/softmax sums
    dots = [e for e in eqns if e.primitive.name == "dot_general"]
    # Every matmul (q, k, QK^T, PV, and their gradients) on bf16 operands but the head's
    # (proj: the model's output) forward, whose result is f32.
    assert {tuple(v.aval.dtype for v in e.invars) for e in dots} == {(BF16, BF16)}
    assert sum(e.outvars[0].aval.dtype == F32 for e in dots) == 1


class TiedLM(nn.Module):
    """wmt's tied head: ``embed.attend(y.astype(jnp.float32))`` on a bf16 decoder (the Embed
    computes in f32, Flax's default); without the upcast, a bf16 Embed."""

    upcast: bool

    @nn.compact
    def __call__(self, tokens):
        embed = nn.Embed(50, 16, dtype=jnp.float32 if self.upcast else jnp.bfloat16,
                         name="embed")
        y = nn.Dense(16, dtype=jnp.bfloat16, name="mlp")(embed(tokens))
        return embed.attend(y.astype(jnp.float32) if self.upcast else y)


@pytest.mark.parametrize("upcast", [True, False])
def test_an_upcast_the_author_wrote_is_kept(upcast):
    model = with_policy(TiedLM(upcast), "bf16-mixed")
    variables = model.init(jax.random.key(0), TOKENS)
    dots = _eqns(lambda v: model.apply(v, TOKENS), variables, name="dot_general")
    head = dots[-1]  # attend: the head, found by role
    want = (F32, F32) if upcast else (BF16, BF16)
    assert tuple(v.aval.dtype for v in head.invars) == want
    assert head.outvars[0].aval.dtype == F32  # logits in f32 either way


class Softplus(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(4, name="out")(jax.nn.softplus(nn.Dense(16, name="fc")(x)))


def test_custom_jvp_bodies_are_interpreted_and_keep_their_rule():
    """jax.nn.softplus is a custom_jvp (logaddexp): its exp/log1p run in f32 under the policy,
    and its gradient is the original rule's (checked against the f32 model in float64)."""
    model = Softplus()
    variables = model.init(jax.random.key(0), X)
    wrapped = with_policy(model, "bf16-mixed")
    eqns = _eqns(lambda v: wrapped.apply(v, X), variables)
    assert _out_dtypes([e for e in eqns if e.primitive.name in ("exp", "log1p")]) == {F32}

    def loss(m, p):
        return jnp.sum(m.apply({"params": p}, X).astype(jnp.float32))

    g = jax.grad(lambda p: loss(wrapped, p))(variables["params"])
    g_ref = jax.grad(lambda p: loss(model, p))(variables["params"])
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_ref)):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert np.linalg.norm(a - b) <= 2.0**-6 * np.linalg.norm(b)  # bf16 matmuls only


def _mlp(params, x):
    h = jax.nn.gelu(x @ params["w1"] + params["b1"][None, :])
    return h @ params["w2"]


PARAMS = {"w1": jnp.asarray(RNG.standard_normal((16, 32)), jnp.float32) / 4,
          "b1": jnp.zeros((32,), jnp.float32),
          "w2": jnp.asarray(RNG.standard_normal((32, 10)), jnp.float32) / 4}


def test_plain_function_fp32_is_exact_and_traces_once():
    policied = with_policy(_mlp, "fp32")
    traces = []

    @jax.jit
    def step(p, x):
        traces.append(1)
        return jax.value_and_grad(lambda q: jnp.mean(policied(q, x) ** 2))(p)

    ref = jax.jit(jax.value_and_grad(lambda q, x: jnp.mean(_mlp(q, x) ** 2)))
    for i in range(3):
        x = X[i] + i
        (l1, g1), (l0, g0) = step(PARAMS, x), ref(PARAMS, x)
        assert np.asarray(l1) == np.asarray(l0)
        jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                     g1, g0)
    assert len(traces) == 1


def test_plain_function_under_fp8_and_bf16():
    x = X[0]
    dots = _eqns(with_policy(_mlp, "fp8-current"), PARAMS, x, name="dot_general")
    assert [tuple(d.name for d in operand_dtypes(e)) for e in dots] == [
        ("float8_e4m3fn", "float8_e4m3fn"), ("bfloat16", "bfloat16")]  # hidden FP8, head bf16
    out = with_policy(_mlp, "bf16-mixed")(PARAMS, x)
    assert out.dtype == F32
    assert jax.vmap(with_policy(_mlp, "bf16-mixed"), in_axes=(None, 0))(PARAMS, X).shape == (
        3, 5, 10)


@pytest.mark.parametrize("name", ["bf16", "bfloat16", "float16", "f32"])
def test_bare_dtype_names_are_refused(name):
    with pytest.raises(ValueError, match="bf16-mixed"):
        with_policy(nn.Dense(3), name)


def test_user_rules_override_the_head_role():
    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(4, name="logits")(nn.Dense(8, name="fc")(x))

    rules = Rules([("^logits$", "p=f32,c=f32,o=f32")], default="p=f32,c=bf16",
                  head="p=f32,c=bf16,o=f32")
    model = with_policy(Net(), rules)
    variables = model.init(jax.random.key(0), X)
    dots = _eqns(lambda v: model.apply(v, X), variables, name="dot_general")
    assert [tuple(v.aval.dtype for v in e.invars) for e in dots] == [(BF16, BF16), (F32, F32)]


class Block(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        return x + nn.Dense(16, name="fc")(jax.nn.relu(x)), None


class LinenStack(nn.Module):
    @nn.compact
    def __call__(self, x):
        stack = nn.scan(nn.remat(Block), variable_axes={"params": 0},
                        split_rngs={"params": True}, length=3)
        x, _ = stack(name="layers")(x, None)
        return nn.Dense(4, name="out")(x)


class NnxBlock(nnx.Module):
    def __init__(self, rngs):
        self.fc = nnx.Linear(16, 16, rngs=rngs)

    def __call__(self, x):
        return x + self.fc(jax.nn.relu(x))


class NnxStack(nnx.Module):
    def __init__(self, rngs):
        @nnx.split_rngs(splits=3)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(rngs):
            return NnxBlock(rngs)

        self.layers = make(rngs)
        self.out = nnx.Linear(16, 4, rngs=rngs)

    def __call__(self, x):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def body(x, layer):
            return layer(x)

        return self.out(body(x, self.layers))


def _histories_per_layer(obs):
    """Observed x amaxes of the stacked layer slot: one per layer, all different."""
    (stacked,) = [o for k, o in obs.items() if k.startswith("layers")]
    assert stacked.shape == (3, 3, fp8.RECIPES["delayed"].history)
    return np.asarray(stacked[:, 0, 0])


def test_delayed_fp8_has_one_history_per_layer_in_linen_scan():
    model = with_policy(LinenStack(), "fp8-delayed")
    variables = model.init(jax.random.key(0), X)
    assert set(variables["fp8_state"]) == {"layers/fc:dot0"}  # the head "out" is not FP8

    def loss(p, s):
        return jnp.sum(model.apply({"params": p, "fp8_state": s}, X).astype(jnp.float32))

    _, obs = jax.grad(loss, argnums=(0, 1))(variables["params"], variables["fp8_state"])
    amax = _histories_per_layer(obs)
    # Layer 0 sees relu(X): its observed input amax is max(relu(X)) of the f32 input, as cast
    # to bf16 (the compute dtype) before quantization.
    want = float(jnp.max(jax.nn.relu(X)).astype(jnp.bfloat16))
    assert amax[0] == pytest.approx(want, rel=0)
    assert len(set(amax.tolist())) == 3
    new = fp8.update_state(variables["fp8_state"], obs)
    assert np.array_equal(np.asarray(new["layers/fc:dot0"][:, 0, 0]), amax)


def test_delayed_fp8_has_one_history_per_layer_in_nnx_scan():
    model = with_policy(NnxStack(nnx.Rngs(0)), "fp8-delayed")
    model(X)  # creates the state
    state = nnx.state(model, nnx.Variable)
    assert "fp8_state" in state

    def loss(m):
        return jnp.sum(m(X).astype(jnp.float32))

    wrt = nnx.DiffState(0, (nnx.Param, _delayed_scaling_variable()))
    grads = nnx.grad(loss, argnums=wrt)(model)
    obs = nnx.to_pure_dict(grads)["fp8_state"]
    amax = _histories_per_layer(obs)
    want = float(jnp.max(jax.nn.relu(X)).astype(jnp.bfloat16))
    assert amax[0] == pytest.approx(want, rel=0)


def _delayed_scaling_variable():
    from fmtkit.policy import DelayedScalingVariable

    return DelayedScalingVariable


def test_inspect_policy_in_nnx_training_mode_and_linen_delayed_defaults():
    class ConvNet(nnx.Module):
        def __init__(self, rngs):
            self.conv = nnx.Conv(1, 4, (3, 3), rngs=rngs)
            self.bn = nnx.BatchNorm(4, rngs=rngs)
            self.drop = nnx.Dropout(0.5)
            self.fc = nnx.Linear(4 * 6 * 6, 10, rngs=rngs)

        def __call__(self, x, rngs):
            h = jax.nn.relu(self.bn(self.conv(x)))
            h = self.drop(h, rngs=rngs)
            return self.fc(h.reshape(h.shape[0], -1))

    model = ConvNet(nnx.Rngs(0))
    x = jnp.asarray(RNG.standard_normal((2, 6, 6, 1)), jnp.float32)
    report = inspect_policy(with_policy(model, "bf16-mixed"), x, nnx.Rngs(dropout=1))
    assert report.modules["conv"].matmuls["forward"] == ("bfloat16 x bfloat16 -> bfloat16",)
    assert report.modules["fc"].head["forward"] == ("bfloat16 x bfloat16 -> float32",)
    assert report.modules["bn"].norm_dtypes == ("float32",)
    linen = inspect_policy(with_policy(LinenStack(), "fp8-delayed"), X)
    fwd = dict(linen.matmuls("forward"))
    assert fwd["layers/fc"].startswith("float8_e4m3fn x float8_e4m3fn")


def test_bf16_policy_is_a_rounding_not_a_new_model():
    """bf16-mixed on a plain function == the same function with operands rounded by hand."""
    x = X[0]
    got = with_policy(_mlp, Policy.parse("p=f32,c=bf16,o=f32"))(PARAMS, x)

    def bf(v):
        return jnp.asarray(v).astype(jnp.bfloat16)

    h = jax.nn.gelu(jnp.dot(bf(x), bf(PARAMS["w1"]), preferred_element_type=BF16)
                    + bf(PARAMS["b1"])[None, :])
    ref = jnp.dot(h, bf(PARAMS["w2"]), preferred_element_type=BF16).astype(F32)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))


def test_delayed_fp8_on_a_plain_function_needs_its_state_passed():
    policied = with_policy(_mlp, "fp8-delayed")
    with pytest.raises(ValueError, match="keyword fp8_state"):
        policied(PARAMS, X[0])


class BatchNormNet(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.BatchNorm(use_running_average=False)(nn.Dense(16, name="fc")(x))
        return nn.Dense(4, name="out")(jax.nn.relu(h))


def test_linen_delayed_init_with_batch_stats():
    model = with_policy(BatchNormNet(), "fp8-delayed")
    variables = model.init(jax.random.key(0), X)
    assert set(variables["fp8_state"]) == {"fc:dot0"}
    out, updates = model.apply(variables, X, mutable=["batch_stats"])
    assert out.dtype == F32 and updates["batch_stats"]["BatchNorm_0"]["mean"].dtype == F32
