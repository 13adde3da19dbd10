"""The three frontends (linen, NNX, plain functions) agree on what a policy does to parameters.

Parameters vs data in the function adapter, one rule for narrow parameters, NNX presets that
leave the user's model alone, delayed FP8 state outside Flax's happy path, and ``Policy``'s
string form / dtype accessors. References are hand-written casts (ml_dtypes) and float64 NumPy.
"""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from jaxpr_utils import dot_operand_dtypes

from fmtkit import fp8
from fmtkit.policy import DelayedScalingVariable, Policy, get_preset, with_policy

F32, BF16 = np.float32, ml_dtypes.bfloat16
RNG = np.random.default_rng(21)
X = jnp.asarray(RNG.standard_normal((4, 8)), jnp.float32)


def _bf16(a) -> np.ndarray:
    """Round-to-nearest-even to bf16, then back to f32 (ml_dtypes: independent of JAX)."""
    return np.asarray(a, F32).astype(BF16).astype(F32)


# ---------------------------------------------------------------------------------------------
# Parameters vs data in the function adapter


def test_a_function_of_data_alone_does_not_round_its_input():
    # The reproducer: values whose bf16 rounding moves the result by ~1e-3.
    x = jnp.asarray([-1.0, 0.0013, 3.0007, 2.0], jnp.float32)
    out = np.asarray(with_policy(lambda x: x - jnp.mean(x), "p=f32,c=bf16")(x))
    x64 = np.asarray(x, np.float64)
    ref = x64 - x64.mean()
    np.testing.assert_allclose(out, ref, rtol=0, atol=2e-7)  # f32 round-off of 4 terms
    rounded = _bf16(x).astype(np.float64) - x64.mean()  # what treating x as a parameter gives
    assert np.max(np.abs(rounded - ref)) > 1e-4  # the check above can tell the two apart


def test_params_argnums_says_which_arguments_are_parameters():
    x = jnp.asarray([-1.0, 0.0013, 3.0007, 2.0], jnp.float32)
    # As a parameter, x is cast to the compute dtype at use (the mean still reads it in f32).
    out = with_policy(lambda x: x - jnp.mean(x), "p=f32,c=bf16", params_argnums=0)(x)
    ref = _bf16(x) - np.float32(np.asarray(x, np.float64).mean())
    np.testing.assert_allclose(np.asarray(out), ref, rtol=0, atol=2e-7)
    # Two positional arguments: the first one holds the parameters (apply(params, x)).
    f = with_policy(lambda w, x: x - w, "p=f32,c=bf16")
    w = jnp.asarray([0.0013, 1.0, 3.0007, 0.5], jnp.float32)
    np.testing.assert_array_equal(np.asarray(f(w, x)), np.asarray(x) - _bf16(w))
    g = with_policy(lambda w, x: x - w, "p=f32,c=bf16", params_argnums=())
    np.testing.assert_array_equal(np.asarray(g(w, x)), np.asarray(x) - np.asarray(w))


def test_params_argnums_is_validated():
    with pytest.raises(TypeError, match="params_argnums"):
        with_policy(lambda x: x, "bf16-mixed", params_argnums="first")
    with pytest.raises(ValueError, match=r"params_argnums=.*argument 2"):
        with_policy(lambda w, x: x, "bf16-mixed", params_argnums=2)(X, X)
    with pytest.raises(TypeError, match="params_argnums is for plain functions"):
        with_policy(nn.Dense(3), "bf16-mixed", params_argnums=0)


class Centered(nn.Module):
    """The input enters elementwise ops (a centring, a residual): where data and parameters
    are told apart."""

    @nn.compact
    def __call__(self, x):
        h = x - jnp.mean(x, axis=-1, keepdims=True)
        h = nn.Dense(8)(h) + x
        return nn.Dense(3)(nn.gelu(h))


@pytest.fixture(scope="module")
def centered():
    model = Centered()
    return model, model.init(jax.random.key(0), X)


@pytest.mark.parametrize("preset", ["bf16-mixed", "p=f32,c=bf16"])
def test_linen_apply_and_the_function_path_agree_bit_for_bit(centered, preset):
    model, variables = centered
    got_model = with_policy(model, preset).apply(variables, X)
    fn = with_policy(lambda v, x: model.apply(v, x), preset)
    np.testing.assert_array_equal(np.asarray(fn(variables, X)), np.asarray(got_model))
    # Negative control: counting the data as a parameter changes the numbers.
    both = with_policy(lambda v, x: model.apply(v, x), preset, params_argnums=(0, 1))
    assert not np.array_equal(np.asarray(both(variables, X)), np.asarray(got_model))


# ---------------------------------------------------------------------------------------------
# Narrow parameters: one rule (an error naming the leaves) in linen, NNX and functions


class Mlp(nnx.Module):
    def __init__(self, rngs, param_dtype=jnp.float32):
        self.l1 = nnx.Linear(8, 16, param_dtype=param_dtype, rngs=rngs)
        self.l2 = nnx.Linear(16, 3, param_dtype=param_dtype, rngs=rngs)

    def __call__(self, x):
        return self.l2(jax.nn.relu(self.l1(x)))


def test_narrow_parameters_raise_in_every_frontend(centered):
    model, variables = centered
    narrow = jax.tree.map(lambda a: a.astype(jnp.bfloat16), variables)
    match = r"narrower than the policy's param_dtype:\n  Dense_0/bias: bfloat16 \(module 'Dense_0'"
    with pytest.raises(ValueError, match=match):
        with_policy(model, "bf16-mixed").apply(narrow, X)
    with pytest.raises(ValueError, match=match):
        with_policy(lambda v, x: model.apply(v, x), "bf16-mixed")(narrow, X)
    nnx_model = Mlp(nnx.Rngs(0), param_dtype=jnp.bfloat16)
    before = jax.tree.map(np.asarray, nnx.state(nnx_model, nnx.Param))
    with pytest.raises(ValueError, match=r"l1/bias: bfloat16 \(module 'l1' stores float32\)"):
        with_policy(nnx_model, "fp8-current")
    after = nnx.state(nnx_model, nnx.Param)  # the user's model is not upcast in place
    assert all(a.dtype == jnp.bfloat16 for a in jax.tree.leaves(after))
    jax.tree.map(np.testing.assert_array_equal, before, jax.tree.map(np.asarray, after))
    eqx_narrow = EqxStyleLinear(jnp.ones((4, 8), jnp.bfloat16), jnp.zeros(4, jnp.float32))
    with pytest.raises(ValueError, match=r"1 parameter.*\n  weight: bfloat16 \(module '<root>'"):
        with_policy(lambda m, x: m(x), "bf16-mixed")(eqx_narrow, X)
    # Same width, another format: refused too (f16 cannot hold bf16's range).
    with pytest.raises(ValueError, match=r"float16 .module 'Dense_0' stores bfloat16"):
        with_policy(model, "pure-bf16").apply(
            jax.tree.map(lambda a: a.astype(jnp.float16), variables), X)


def test_wider_parameters_are_used_as_given(centered):
    """f32 parameters under pure-bf16 (p=bf16): cast to bf16 at use, as bf16 storage would."""
    model, variables = centered
    got = with_policy(model, "pure-bf16").apply(variables, X)
    stored = jax.tree.map(lambda a: a.astype(jnp.bfloat16), variables)
    want = with_policy(model, "pure-bf16").apply(stored, X)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got, F32), np.asarray(want, F32))


def test_nnx_presets_leave_the_original_bit_identical():
    model = Mlp(nnx.Rngs(0))
    w0 = jax.tree.map(lambda a: np.array(a, copy=True), nnx.state(model, nnx.Param))
    ref = np.asarray(model(X))
    out = with_policy(model, "pure-bf16")(X)
    assert out.dtype == jnp.bfloat16
    # The bf16 copy computes on the bf16-rounded weights (hand-cast reference, f64 matmuls).
    x, k1, b1, k2, b2 = (_bf16(a).astype(np.float64) for a in (
        X, w0["l1"]["kernel"], w0["l1"]["bias"], w0["l2"]["kernel"], w0["l2"]["bias"]))
    h = _bf16(np.maximum(_bf16(x @ k1 + b1), 0)).astype(np.float64)
    np.testing.assert_allclose(np.asarray(out, np.float64), h @ k2 + b2, rtol=2e-2, atol=2e-2)
    back = with_policy(model, "fp32")
    jax.tree.map(np.testing.assert_array_equal, w0,
                 jax.tree.map(np.asarray, nnx.state(model, nnx.Param)))
    np.testing.assert_array_equal(np.asarray(back(X)), ref)  # fp32: the unwrapped model


# ---------------------------------------------------------------------------------------------
# Delayed FP8 outside Flax's happy path


def test_nnx_functional_grad_over_params_only_leaves_histories_alone():
    model = with_policy(Mlp(nnx.Rngs(1)), "fp8-delayed")
    model(X)  # creates the histories
    graphdef, params, state, rest = nnx.split(model, nnx.Param, DelayedScalingVariable, ...)
    hist0 = jax.tree.map(np.asarray, state)

    def loss(p, s):
        return jnp.mean(nnx.merge(graphdef, p, s, rest)(X).astype(jnp.float32) ** 2)

    g_params = jax.jit(jax.grad(loss))(params, state)
    jax.tree.map(np.testing.assert_array_equal, hist0,
                 jax.tree.map(np.asarray, nnx.state(model, DelayedScalingVariable)))
    # Differentiating the histories too gives the same parameter gradients plus amaxes.
    g_both, g_state = jax.jit(jax.grad(loss, argnums=(0, 1)))(params, state)
    jax.tree.map(np.testing.assert_array_equal, g_params, g_both)
    new = fp8.update_state(state, g_state)
    assert all(float(h[..., 0].min()) > 0 for h in jax.tree.leaves(new))


def _mlp(params, x):
    return jnp.tanh(x @ params["w1"]) @ params["w2"]


MLP_PARAMS = {"w1": jnp.asarray(RNG.standard_normal((8, 16)), jnp.float32),
              "w2": jnp.asarray(RNG.standard_normal((16, 4)), jnp.float32) / 4}


def test_a_plain_function_takes_and_returns_its_amax_state():
    policied = with_policy(_mlp, "fp8-delayed")
    state = policied.init_fp8_state(MLP_PARAMS, X)
    # One history: x @ w1. The second matmul makes the output: the head, never FP8.
    assert list(state) == ["<root>:dot0"] and state["<root>:dot0"].shape == (3, 1024)
    assert all(float(jnp.abs(h).max()) == 0 for h in state.values())

    def loss(p, s, x):
        return jnp.sum(policied(p, x, fp8_state=s) ** 2)

    closed = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(MLP_PARAMS, state, X)
    assert sum(d == (jnp.float8_e4m3fn, jnp.float8_e4m3fn)
               for d in dot_operand_dtypes(closed)) == 1  # x @ w1's forward GEMM
    g_params, observed = jax.jit(jax.grad(loss, argnums=(0, 1)))(MLP_PARAMS, state, X)
    assert all(bool(jnp.isfinite(g).all()) for g in jax.tree.leaves(g_params))
    new = fp8.update_state(state, observed)
    # The first projection read bf16(x) and bf16(w1): its history records their amaxes.
    row = np.asarray(new["<root>:dot0"][:, 0])
    assert row[0] == np.abs(_bf16(X)).max() and row[1] == np.abs(_bf16(MLP_PARAMS["w1"])).max()
    assert row[2] > 0 and not np.asarray(new["<root>:dot0"][:, 1:]).any()
    with pytest.raises(TypeError, match="fp8_state must be the dict"):
        policied(MLP_PARAMS, X, fp8_state=[1.0])


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class EqxStyleLinear:
    """An Equinox-style model: a pytree of arrays whose ``__call__`` is the forward pass."""

    weight: jax.Array
    bias: jax.Array

    def __call__(self, x):
        return x @ self.weight.T + self.bias[None, :]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class EqxStyleMlp:
    l1: EqxStyleLinear
    l2: EqxStyleLinear

    def __call__(self, x):
        return self.l2(jnp.tanh(self.l1(x)))


def test_an_equinox_style_model_uses_the_same_protocol():
    w1, w2 = (jnp.asarray(RNG.standard_normal(s), jnp.float32) / 3 for s in ((16, 8), (4, 16)))
    m = EqxStyleMlp(EqxStyleLinear(w1, jnp.zeros(16)), EqxStyleLinear(w2, jnp.zeros(4)))
    policied = with_policy(lambda m, x: m(x), "fp8-delayed")
    state = policied.init_fp8_state(m, X)
    assert len(state) == 1  # l1; l2 is the head
    closed = jax.make_jaxpr(lambda s: policied(m, X, fp8_state=s))(state)
    assert (jnp.float8_e4m3fn, jnp.float8_e4m3fn) in dot_operand_dtypes(closed)
    y = policied(m, X, fp8_state=state)
    assert y.dtype == jnp.float32  # bf16-mixed's model outputs
    ref = np.tanh(np.asarray(X, np.float64) @ np.asarray(w1, np.float64).T) @ np.asarray(
        w2, np.float64).T
    # E4M3 operands (3 mantissa bits, per-tensor scales) into a bf16 head: a few % of |y|.
    np.testing.assert_allclose(np.asarray(y), ref, rtol=0, atol=0.1 * np.abs(ref).max())


# ---------------------------------------------------------------------------------------------
# Policy: string form, dtype accessors, near-miss names


def test_str_round_trips_a_customised_recipe():
    recipe = dataclasses.replace(fp8.RECIPES["delayed"], history=16, margin=2)
    p = Policy("float32", "bfloat16", fp8=recipe)
    assert str(p) == "p=f32,c=bf16,o=bf16,g=bf16,fp8=delayed(history=16, margin=2)"
    back = Policy.parse(str(p))
    assert back == p and back.fp8 == recipe and back.fp8.history == 16
    custom = fp8.Fp8Recipe(name="mine", x_tile="1x128", w_tile="128x128", grad_tile="1x128")
    assert Policy.parse(str(Policy(fp8=custom))).fp8 == custom
    with pytest.raises(ValueError, match=r"unknown field.*histry"):
        Policy.parse("fp8=delayed(histry=16)")


def test_policy_dtypes_are_dtypes():
    p = Policy.parse("c=bf16")
    assert p.compute_dtype == jnp.bfloat16 and p.param_dtype == jnp.float32
    assert p.compute_dtype == "bfloat16"  # and still equal to their names
    assert jnp.zeros(2, p.compute_dtype).dtype == jnp.bfloat16
    assert hash(p) == hash(Policy.parse(str(p)))  # hashable: a static argument
    assert jax.jit(lambda x, p: x.astype(p.compute_dtype), static_argnums=1)(X, p).dtype == (
        jnp.bfloat16)


@pytest.mark.parametrize("name", ["bf16_mixed", "BF16-mixed", "fp8_delayd"])
def test_near_miss_preset_names_get_a_suggestion(name):
    want = "fp8-delayed" if "fp8" in name else "bf16-mixed"
    with pytest.raises(ValueError, match=f"Did you mean '{want}'"):
        with_policy(lambda x: x, name)
    with pytest.raises(ValueError, match=f"Did you mean '{want}'"):
        get_preset(name)


# ---------------------------------------------------------------------------------------------
# The linen policied model as an nn.Module


class Parent(nn.Module):
    preset: str

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(8)(x)  # the parent's own layer: no policy
        return with_policy(Centered(), self.preset).as_module(name="sub")(h)


@pytest.mark.parametrize("preset", ["bf16-mixed", "fp8-delayed"])
def test_a_policied_model_nests_in_a_parent_module(preset):
    parent = Parent(preset)
    v = parent.init(jax.random.key(0), X)
    alone = with_policy(Centered(), preset)
    ref_v = alone.init(jax.random.key(1), X)
    assert jax.tree.structure(v["params"]["sub"]) == jax.tree.structure(ref_v["params"])
    assert ("fp8_state" in v) == (preset == "fp8-delayed")
    y = parent.apply(v, X)
    # The sub-model computes exactly what the policied model computes on its own.
    h = nn.Dense(8).apply({"params": v["params"]["Dense_0"]}, X)
    sub = {"params": v["params"]["sub"]}
    if "fp8_state" in v:
        sub["fp8_state"] = v["fp8_state"]["sub"]
    np.testing.assert_array_equal(np.asarray(y), np.asarray(alone.apply(sub, h)))
    np.testing.assert_array_equal(np.asarray(parent.bind(v)(X)), np.asarray(y))
    dots = dot_operand_dtypes(jax.make_jaxpr(lambda v: parent.apply(v, X))(v))
    assert dots[0] == (jnp.float32, jnp.float32)  # the parent's Dense, untouched
    low = (jnp.float8_e4m3fn,) * 2 if preset == "fp8-delayed" else (jnp.bfloat16,) * 2
    assert low in dots[1:] and (jnp.float32, jnp.float32) not in dots[1:]


def test_a_nested_policied_model_tabulates_and_trains_its_fp8_state():
    parent = Parent("fp8-delayed")
    table = nn.tabulate(parent, jax.random.key(0))(X)
    assert "PolicyModu" in table and "sub" in table  # (rich truncates the class name)
    v = parent.init(jax.random.key(0), X)

    def loss(params, state):
        return jnp.mean(parent.apply({"params": params, "fp8_state": state}, X) ** 2)

    g, observed = jax.grad(loss, argnums=(0, 1))(v["params"], v["fp8_state"])
    assert all(a.dtype == jnp.float32 for a in jax.tree.leaves(g))
    new = fp8.update_state(v["fp8_state"], observed)
    assert all(float(h[..., 0].min()) > 0 for h in jax.tree.leaves(new))


def test_nnx_converted_copies_keep_tied_params_tied():
    class Tied(nnx.Module):
        def __init__(self, rngs):
            self.a = nnx.Linear(8, 8, rngs=rngs)
            self.b = nnx.Linear(8, 8, rngs=rngs)
            self.b.kernel = self.a.kernel  # one Variable, two modules

        def __call__(self, x):
            return self.b(self.a(x))

    model = Tied(nnx.Rngs(0))
    wrapped = with_policy(model, "pure-bf16")
    assert wrapped.a.kernel is wrapped.b.kernel and wrapped.a.kernel is not model.a.kernel
    assert wrapped.a.kernel[...].dtype == jnp.bfloat16 and model.a.kernel[...].dtype == jnp.float32


def test_a_one_argument_function_under_fp8_says_what_counts_as_parameters():
    def loss(params):  # the data is closed over: f(params)
        return jnp.sum(jnp.tanh(X @ params["w1"]) @ params["w2"])

    with pytest.warns(UserWarning, match="pass params_argnums=0"):
        with_policy(loss, "fp8-current")(MLP_PARAMS)
    closed = jax.make_jaxpr(with_policy(loss, "fp8-current", params_argnums=0))(MLP_PARAMS)
    assert (jnp.float8_e4m3fn, jnp.float8_e4m3fn) in dot_operand_dtypes(closed)
