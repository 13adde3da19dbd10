"""Roles a policy gives by what the computation does, and what must never move them.

The head (first output leaf, or ``mark_head``) is unchanged by auxiliary outputs, L2 penalties
and aux losses; a router rule covers the router's whole subtree (its gating Dense); a bf16
round trip in MoE dispatch is not an author's upcast; batched expert GEMMs run delayed FP8;
``fmtkit.cast(..., rounding="stochastic")`` runs inside a policied model.

Dtypes and FLOP shares are read from the jaxpr of the gradient by ``jaxpr_utils`` (a walker
independent of the policy's own report), values against unpolicied or hand-cast references.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from jax import lax
from jax.interpreters import partial_eval as pe
from jaxpr_utils import COTANGENT, DATA, PARAM, iter_eqns, label_eqns, matmuls

import fmtkit
from fmtkit import fp8
from fmtkit.policy import Rules, get_preset, inspect_policy, list_presets, mark_head, with_policy

BF16, F16, F32 = jnp.dtype("bfloat16"), jnp.dtype("float16"), jnp.dtype("float32")
RNG = np.random.default_rng(0)
X = jnp.asarray(RNG.standard_normal((4, 8)), jnp.float32)
LABELS = jnp.asarray(RNG.integers(0, 6, (4,)), jnp.int32)


def _dots(fn, *args):
    """(lhs dtype, rhs dtype, rhs shape, out dtype, lhs shape) of every dot_general in fn's
    jaxpr."""
    return [(e.invars[0].aval.dtype, e.invars[1].aval.dtype, e.invars[1].aval.shape,
             e.outvars[0].aval.dtype, e.invars[0].aval.shape)
            for e in iter_eqns(jax.make_jaxpr(fn)(*args)) if e.primitive.name == "dot_general"]


# ---------------------------------------------------------------------------------------------
# The head: aux outputs, L2 and aux losses, mark_head.


class Mlp(nn.Module):
    """Dense -> relu -> Dense head; ``aux`` adds outputs a user might return beside logits."""

    aux: str = "none"

    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.Dense(16, name="hidden")(x))
        logits = nn.Dense(6, name="out")(h)
        if self.aux == "features":  # a dict of features: used to make "hidden" a second head
            return logits, {"features": h, "probe": nn.Dense(3, name="probe")(h)}
        if self.aux == "dict":  # leaves sorted by key: "a_features" comes before "logits"
            return {"a_features": h, "logits": mark_head(logits)}
        if self.aux == "dict_unmarked":
            return {"a_features": h, "logits": logits}
        if self.aux == "scaled":  # CLIP's learned logit scale: computed from a parameter alone
            return logits * jnp.exp(self.param("logit_scale", nn.initializers.zeros, ()))
        return logits


@pytest.fixture(scope="module")
def mlp_params():
    return with_policy(Mlp("features"), "bf16-mixed").init(jax.random.key(0), X)["params"]


def _logits(aux, params):
    out = with_policy(Mlp(aux), "bf16-mixed").apply({"params": params}, X)
    return out["logits"] if isinstance(out, dict) else out[0] if isinstance(out, tuple) else out


def test_aux_outputs_leave_the_logits_bit_identical(mlp_params):
    plain = {k: v for k, v in mlp_params.items() if k != "probe"}
    ref = _logits("none", plain)
    for aux in ("features", "dict"):
        np.testing.assert_array_equal(np.asarray(_logits(aux, mlp_params)), np.asarray(ref))
    # No second head: the feature and probe projections keep bf16 outputs.
    dots = _dots(lambda p: with_policy(Mlp("features"), "bf16-mixed").apply({"params": p}, X),
                 mlp_params)
    assert {d[2]: d[3] for d in dots} == {(8, 16): BF16, (16, 6): F32, (16, 3): BF16}, dots
    # The hand-cast reference of bf16-mixed: bf16 hidden layer, bf16 x bf16 -> f32 head.
    p = jax.tree.map(lambda t: t.astype(BF16), plain)
    h = jax.nn.relu(jnp.dot(X.astype(BF16), p["hidden"]["kernel"]) + p["hidden"]["bias"][None])
    hand = (jnp.dot(h, p["out"]["kernel"], preferred_element_type=F32)
            + p["out"]["bias"][None].astype(F32))
    np.testing.assert_array_equal(np.asarray(ref), np.asarray(hand))


class NnxMlp(nnx.Module):
    def __init__(self, aux: bool, *, rngs: nnx.Rngs):
        self.aux = aux
        self.hidden = nnx.Linear(8, 16, rngs=rngs)
        self.out = nnx.Linear(16, 6, rngs=rngs)

    def __call__(self, x):
        h = nnx.relu(self.hidden(x))
        logits = self.out(h)
        return (logits, {"features": h}) if self.aux else logits


def test_nnx_aux_outputs_leave_the_logits_bit_identical():
    plain = with_policy(NnxMlp(False, rngs=nnx.Rngs(0)), "bf16-mixed")
    aux = with_policy(NnxMlp(True, rngs=nnx.Rngs(0)), "bf16-mixed")
    np.testing.assert_array_equal(np.asarray(aux(X)[0]), np.asarray(plain(X)))
    dots = _dots(lambda x: aux(x)[0], X)
    assert {d[2]: d[3] for d in dots} == {(8, 16): BF16, (16, 6): F32}, dots


def test_the_first_output_leaf_is_the_main_output_unless_marked(mlp_params):
    """Unmarked, a dict whose first leaf (by sorted key) is the features makes "hidden" the
    head (f32 output) and the logits change; ``mark_head`` names the real one."""
    params = {k: v for k, v in mlp_params.items() if k != "probe"}

    def dots(aux):
        return _dots(lambda p: with_policy(Mlp(aux), "bf16-mixed").apply({"params": p}, X),
                     params)

    head_out = (BF16, BF16, (16, 6), F32, (4, 16))
    assert head_out in dots("dict") and (BF16, BF16, (8, 16), BF16, (4, 8)) in dots("dict")
    assert (BF16, BF16, (8, 16), F32, (4, 8)) in dots("dict_unmarked")  # negative control
    assert head_out not in dots("dict_unmarked")
    assert mark_head(X) is X  # outside a policied trace: nothing happens


def test_a_value_computed_from_parameters_alone_keeps_the_head():
    model = with_policy(Mlp("scaled"), "bf16-mixed")
    params = model.init(jax.random.key(0), X)["params"]
    dots = _dots(lambda p: model.apply({"params": p}, X), params)
    assert {d[2]: d[3] for d in dots} == {(8, 16): BF16, (16, 6): F32}, dots


def _ce(logits, labels):
    logp = jax.nn.log_softmax(logits.astype(F32))
    return -jnp.mean(jnp.take_along_axis(logp, labels[:, None], axis=1))


@pytest.mark.parametrize("terms", ["l2", "aux", "l2+aux"])
def test_l2_and_aux_loss_terms_keep_the_head(mlp_params, terms):
    model = Mlp("features")

    def loss(params, x, labels, terms):
        logits, aux = model.apply({"params": params}, x)
        value = _ce(logits, labels)
        if "l2" in terms:
            value = value + 1e-4 * sum(jnp.sum(jnp.square(w)) for w in jax.tree.leaves(params))
        if "aux" in terms:  # an aux loss from another output, as MoE load balancing is
            value = value + 1e-2 * jnp.mean(jnp.square(aux["probe"].astype(F32)))
        return value

    policied = with_policy(loss, "bf16-mixed")

    def dots(t):
        return _dots(jax.value_and_grad(lambda p: policied(p, X, LABELS, t)), mlp_params)

    def main(found):  # the dots of the main path (the probe's only run when its loss does)
        return sorted(str(d) for d in found if 3 not in d[2] and 3 not in d[4])

    base, extra = dots(""), dots(terms)
    head_fwd = (BF16, BF16, (16, 6), F32, (4, 16))
    assert head_fwd in base and head_fwd in extra
    assert main(base) == main(extra)  # every dtype unchanged
    if "aux" in terms:  # the aux loss's projection is not made a second head
        assert {d[3] for d in extra if d[2] == (16, 3)} == {BF16}, extra


# ---------------------------------------------------------------------------------------------
# A mixture of experts as V-MoE / Switch / flaxformer write it: a router module whose gating
# is a child Dense, top-k dispatch with capacity, a bf16 round trip around the dispatch
# einsum, per-expert GEMMs as einsums over a leading expert axis, an aux loss output.

G, S, DIN, D, F, E, K, C, CLASSES = 2, 8, 16, 32, 64, 4, 2, 8, 10


class TopKRouter(nn.Module):
    @nn.compact
    def __call__(self, x):  # [G, S, D]
        logits = nn.Dense(E, use_bias=False, name="dense")(x)
        probs = jax.nn.softmax(logits.astype(F32), axis=-1)
        gates, idx = lax.top_k(probs, K)  # [G, S, K]
        mask = jax.nn.one_hot(idx, E, dtype=F32)  # [G, S, K, E]
        m = mask.transpose(0, 2, 1, 3).reshape(G, K * S, E)  # first choices first
        pos = (jnp.cumsum(m, axis=1) * m).reshape(G, K, S, E).transpose(0, 2, 1, 3) - 1.0
        keep = mask * (pos < C).astype(F32)
        slot = jax.nn.one_hot(jnp.sum(pos * keep, axis=-1).astype(jnp.int32), C)
        dispatch_k = keep[..., None] * slot[..., None, :]  # [G, S, K, E, C]
        combine = jnp.sum(gates[..., None, None] * dispatch_k, axis=2)
        density = jnp.mean(mask[:, :, 0, :], axis=1)
        aux = jnp.mean(density * jnp.mean(probs, axis=1)) * E * E
        return jnp.sum(dispatch_k, axis=2), combine, aux


class MoeLayer(nn.Module):
    @nn.compact
    def __call__(self, x):
        dispatch, combine, aux = TopKRouter(name="router")(x)
        dtype = x.dtype
        routed = jnp.einsum("gsec,gsd->egcd", dispatch.astype(BF16), x.astype(BF16))
        routed = routed.astype(dtype)  # the round trip
        wi = self.param("wi", nn.initializers.lecun_normal(), (E, D, F))
        wo = self.param("wo", nn.initializers.lecun_normal(), (E, F, D))
        h = nn.gelu(jnp.einsum("egcd,edf->egcf", routed, wi))
        out = jnp.einsum("egcf,efd->egcd", h, wo)
        return jnp.einsum("gsec,egcd->gsd", combine, out), aux


class MoeClassifier(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.Dense(D, name="embed")(x)
        y, aux = MoeLayer(name="moe")(nn.LayerNorm(name="ln")(h))
        h = h + y
        logits = nn.Dense(CLASSES, name="head")(nn.LayerNorm(name="ln_f")(h).mean(axis=1))
        return logits, {"aux_loss": aux}


X_MOE = jnp.asarray(RNG.standard_normal((G, S, DIN)), jnp.float32)
Y_MOE = jnp.asarray(RNG.standard_normal((G, CLASSES)), jnp.float32)


def _moe_loss(model):
    def loss(params, state, x):
        variables = {"params": params, **({"fp8_state": state} if state else {})}
        logits, aux = model.apply(variables, x)
        return jnp.mean(jnp.square(logits.astype(F32) - Y_MOE)) + 1e-2 * aux["aux_loss"]
    return loss


@pytest.fixture(scope="module")
def moe_variables():
    return {preset: with_policy(MoeClassifier(), preset).init(jax.random.key(0), X_MOE)
            for preset in ("bf16-mixed",)}


@pytest.mark.parametrize("preset,half", [("bf16-mixed", BF16), ("fp16-mixed", F16)])
def test_moe_router_gating_in_f32_and_expert_gemms_in_half_after_the_round_trip(
        moe_variables, preset, half):
    params = moe_variables["bf16-mixed"]["params"]
    loss = _moe_loss(with_policy(MoeClassifier(), preset))
    dots = _dots(jax.grad(lambda p: loss(p, None, X_MOE)), params)
    gating = [d for d in dots if (D, E) in (d[2], d[4])
              or {d[2], d[4]} == {(G, S, D), (G, S, E)}]
    # forward, data gradient and weight gradient of the gating Dense: f32 x f32
    assert len(gating) == 3 and all(d[:2] == (F32, F32) for d in gating), gating
    experts = [d for d in dots if d[2] in ((E, D, F), (E, F, D))]
    assert len(experts) == 4 and all(d[:2] == (half, half) for d in experts), experts
    assert not [d for d in dots if d[:2] == (F32, F32) and d not in gating], dots


def _fp8_shares(preset):
    """(forward, data-gradient) share of the non-head parameter-matmul FLOPs on FP8 operands,
    from the jaxpr of loss and its vjp with the cotangent seed as an input."""
    model = with_policy(MoeClassifier(), preset)
    variables = model.init(jax.random.key(0), X_MOE)
    params, state = variables["params"], variables.get("fp8_state")
    loss = _moe_loss(model)

    def step(params, x, ct):
        value, pullback = jax.vjp(lambda p: loss(p, state, x), params)
        return value, pullback(ct)[0]

    closed = jax.make_jaxpr(step)(params, X_MOE, jnp.float32(1))
    # What the compiled step runs: without dead equations (an FP8 GEMM's backward writes the
    # first projection's data gradient into the input, which nothing uses).
    live, _ = pe.dce_jaxpr(closed.jaxpr, [True] * len(closed.jaxpr.outvars), instantiate=True)
    closed = jax.extend.core.ClosedJaxpr(live, closed.consts)
    labels = ([{PARAM}] * len(jax.tree.leaves(params)) + [{DATA}] + [{COTANGENT}])
    records, outs = label_eqns(closed, labels)
    found = matmuls(records, outs[1:], head_size=CLASSES)
    shares = []
    for role in ("fwd", "dgrad"):
        sel = [m for m in found if m.role == role]
        assert sel, found
        shares.append(sum(m.flops for m in sel if m.fp8) / sum(m.flops for m in sel))
    return shares, found, state


@pytest.mark.parametrize("preset", [p for p in list_presets() if p.startswith("fp8-")])
def test_moe_fp8_presets_cover_95_percent_of_parameter_matmul_flops(preset):
    (fwd, dgrad), found, state = _fp8_shares(preset)
    assert fwd >= 0.95 and dgrad >= 0.95, (fwd, dgrad, found)
    # The policy's own report says the same numbers as the independent walker.
    def loss_fn(out):
        logits, aux = out
        return jnp.mean(jnp.square(logits.astype(F32) - Y_MOE)) + 1e-2 * aux["aux_loss"]

    report = inspect_policy(with_policy(MoeClassifier(), preset), X_MOE, loss_fn=loss_fn)
    assert report.fp8_fraction("forward") == pytest.approx(fwd, rel=1e-12)
    assert report.fp8_fraction("dgrad") == pytest.approx(dgrad, rel=1e-12)
    # Independent of the walker: each expert GEMM has its own history under "delayed".
    if preset == "fp8-delayed":
        shapes = {k: v.shape for k, v in state.items()}
        assert shapes == {"embed:dot0": (3, 1024), "moe:dot0": (E, 3, 1024),
                          "moe:dot1": (E, 3, 1024)}, shapes


@pytest.mark.slow
def test_delayed_expert_histories_observe_each_experts_own_amax():
    """One step of fp8-delayed records, per expert, max|wi[e]| (a float64 NumPy reference)."""
    model = with_policy(MoeClassifier(), "fp8-delayed")
    variables = model.init(jax.random.key(0), X_MOE)
    params, state = variables["params"], variables["fp8_state"]
    loss = _moe_loss(model)
    obs = jax.jit(jax.grad(loss, argnums=1))(params, state, X_MOE)
    new = fp8.update_state(state, obs)
    # The FP8 recipe quantizes the bf16 compute copy of the weights (rounded by ml_dtypes).
    wi = np.asarray(params["moe"]["wi"]).astype(ml_dtypes.bfloat16).astype(np.float64)
    np.testing.assert_array_equal(np.asarray(new["moe:dot0"][:, 1, 0]),
                                  np.abs(wi).max(axis=(1, 2)).astype(np.float32))
    assert len(set(np.asarray(new["moe:dot0"][:, 1, 0]).tolist())) > 1  # not one per tensor


# ---------------------------------------------------------------------------------------------
# Rules: subtree patterns; round trips; dtype-exact primitives.


class MyGate(nn.Module):
    @nn.compact
    def __call__(self, x):
        return jax.nn.softmax(nn.Dense(4, name="proj")(x))


class Gated(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(4, name="out")(MyGate(name="g")(x) * nn.Dense(4, name="v")(x))


@pytest.mark.parametrize("pattern,gate_dtype", [("subtree:type:^MyGate$", F32),
                                                ("type:^MyGate$", BF16),
                                                ("subtree:(^|/)g$", F32)])
def test_subtree_rules_cover_the_modules_a_router_calls(pattern, gate_dtype):
    model = with_policy(Gated(), Rules([(pattern, "f32")], default="c=bf16"))
    params = model.init(jax.random.key(0), X)["params"]
    dots = _dots(lambda p: model.apply({"params": p}, X), params)
    assert dots[0][:2] == (gate_dtype, gate_dtype) and dots[0][2] == (8, 4)
    assert all(d[:2] == (BF16, BF16) for d in dots[1:]), dots


class RoundTrip(nn.Module):
    @nn.compact
    def __call__(self, x, idx):
        w = self.param("w", nn.initializers.lecun_normal(), (8, 8))
        h = nn.Dense(8, name="proj")(x)  # f32 in the trace, bf16 under c=bf16
        y = jnp.take(h.astype(BF16), idx, axis=0).astype(h.dtype)  # round trip
        z = jnp.dot(x.astype(BF16), w.astype(BF16)).astype(F32)  # made bf16, then upcast
        return y @ w, z @ w


def test_a_round_trip_follows_the_compute_dtype_but_an_upcast_is_kept():
    idx = jnp.asarray([2, 0, 1], jnp.int32)
    variables = RoundTrip().init(jax.random.key(0), X, idx)
    model = with_policy(RoundTrip(), Rules((), default="c=bf16"))
    dots = _dots(lambda v: model.apply(v, X, idx), variables)
    assert [d[:2] for d in dots] == [(BF16, BF16)] * 3 + [(F32, F32)], dots
    # The way back restores the dtype the value had here before (bf16): no f32 copy.
    widened = [e for e in iter_eqns(jax.make_jaxpr(lambda v: model.apply(v, X, idx))(variables))
               if e.primitive.name == "convert_element_type" and e.outvars[0].aval.dtype == F32
               and e.invars[0].aval.shape == (3, 8)]
    assert not widened, widened
    # Under f32 compute the round trip is the author's rounding, kept exactly.
    out = with_policy(RoundTrip(), "fp32").apply(variables, X, idx)
    np.testing.assert_array_equal(np.asarray(out[0]),
                                  np.asarray(RoundTrip().apply(variables, X, idx)[0]))


class StochasticCast(nn.Module):
    cast: bool = True

    @nn.compact
    def __call__(self, x, key):
        h = nn.Dense(16, name="a")(x)
        if self.cast:
            h = fmtkit.cast(h, "bf16", rounding="stochastic", key=key).astype(h.dtype)
        return nn.Dense(6, name="b")(h)


def test_stochastic_rounding_cast_runs_inside_a_policied_model():
    key = jax.random.key(3)
    variables = StochasticCast().init(jax.random.key(0), X, key)

    def run(preset, cast):
        model = with_policy(StochasticCast(cast), preset)
        return jax.value_and_grad(lambda v: jnp.sum(model.apply(v, X, key)))(variables)

    # bf16-mixed: h is already bf16, so rounding it to bf16 is exact, whatever the noise.
    (v_cast, g_cast), (v_plain, g_plain) = run("bf16-mixed", True), run("bf16-mixed", False)
    assert v_cast == v_plain
    jax.tree.map(np.testing.assert_array_equal, g_cast, g_plain)
    # fp32: the unwrapped model's stochastic rounding, bit for bit.
    value, _ = run("fp32", True)
    assert value == jnp.sum(StochasticCast().apply(variables, X, key))


def test_presets_name_their_router_rules_as_subtree_rules():
    for name in ("bf16-mixed", "fp16-mixed", "fp8-current"):
        rules = get_preset(name)
        for path, types, anc in [("moe/router/dense", ("Dense",), (("Moe",), ("Router",))),
                                 ("blocks/0/gate/linear", ("Linear",), ()),
                                 ("m/x/dense", ("Dense",), (("NoisyTopExpertsPerItemRouter",),))]:
            policy = rules.resolve(path, types, anc)
            assert (policy.compute_dtype, policy.output_dtype, policy.fp8) == (
                "float32", "float32", None), (name, path)
        assert rules.resolve("moe/expert/dense", ("Dense",), (("Moe",),)).compute_dtype != \
            "float32"


def test_batched_delayed_dot_is_one_delayed_dot_per_batch_element():
    """fmtkit.fp8.dot_general_fn("delayed") with batch dims and a [B, 3, H] state equals, per
    batch element, the unbatched delayed dot on that element's history (forward and the
    observed amaxes); a [3, H] state for a batched dot is refused."""
    dg = fp8.dot_general_fn("delayed")
    dn_b, dn = (((2,), (1,)), ((0,), (0,))), (((1,), (0,)), ((), ()))
    x = jnp.asarray(RNG.standard_normal((3, 4, 8)) * [[[1.0]], [[10.0]], [[0.1]]], F32)
    w = jnp.asarray(RNG.standard_normal((3, 8, 5)), F32)
    hist = jnp.asarray(RNG.uniform(0.5, 20.0, (3, 3, 1024)), F32)

    def batched(x, w, h):
        return jnp.sum(dg(x, w, dn_b, fp8_state=fmtkit.DelayedScalingState(h)) ** 2)

    def single(x, w, h):
        return jnp.sum(dg(x, w, dn, fp8_state=fmtkit.DelayedScalingState(h)) ** 2)

    out = dg(x, w, dn_b, fp8_state=fmtkit.DelayedScalingState(hist))
    obs = jax.grad(batched, argnums=2)(x, w, hist)
    for b in range(3):
        np.testing.assert_array_equal(np.asarray(out[b]), np.asarray(
            dg(x[b], w[b], dn, fp8_state=fmtkit.DelayedScalingState(hist[b]))))
        np.testing.assert_array_equal(np.asarray(obs[b]),
                                      np.asarray(jax.grad(single, argnums=2)(x[b], w[b], hist[b])))
    # the observed x amax of each element is its own max |x| (float64 NumPy)
    np.testing.assert_array_equal(np.asarray(obs[:, 0, 0]),
                                  np.abs(np.asarray(x, np.float64)).max(axis=(1, 2)))
    with pytest.raises(ValueError, match=r"needs \(3, 3, 1024\)"):
        dg(x, w, dn_b, fp8_state=fp8.init_state())
