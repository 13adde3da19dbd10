"""A decoder written the way MaxText writes its own (layers under nn.scan, an einsum with the
weight on the left, MoE experts through jax.lax.ragged_dot, a router kept in f32), quantized
by a FmtkitProvider with MaxText's rule path ("decoder/.*layers.*"): loss and gradients equal
the same model wired to fmtkit.fp8 by hand, bit for bit, and every weight GEMM of the matched
layers takes FP8 operands in the forward, data-gradient and weight-gradient passes."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

qwix = pytest.importorskip("qwix")

from fp8_provenance import fp8_operands  # noqa: E402
from jaxpr_utils import COTANGENT, DATA, PARAM, label_eqns, matmul_role  # noqa: E402

from fmtkit import fp8  # noqa: E402
from fmtkit.qwix import FmtkitProvider, FmtkitRule  # noqa: E402

pytestmark = pytest.mark.slow  # compiles a two-layer scanned MoE decoder and its gradient

D, F, E, LAYERS = 128, 256, 4, 2


class DecoderLayer(nn.Module):
    recipe: str | None = None  # None: plain JAX ops (what qwix intercepts); else fmtkit by hand

    @nn.compact
    def __call__(self, x, _):
        init = nn.initializers.lecun_normal()
        h = x * jax.lax.rsqrt(jnp.mean(jnp.square(x), -1, keepdims=True) + 1e-6)
        dg = {} if self.recipe is None else {"dot_general": fp8.dot_general_fn(self.recipe)}
        q = nn.Dense(D, use_bias=False, name="query", **dg)(h)
        # MaxText-style output projection, written with the weight first.
        wo = self.param("out", init, (D, D))
        if self.recipe is None:
            attn = jnp.einsum("dk,btk->btd", wo, jax.nn.gelu(q))
        else:
            attn = fp8.dot_general_fn(self.recipe)(jax.nn.gelu(q), wo, (((2,), (1,)), ((), ())))
        x = x + attn
        # MoE: a router in f32 (exempted by its own rule), top-1, tokens sorted by expert.
        tokens = x.reshape(-1, D)
        logits = nn.Dense(E, use_bias=False, name="router")(tokens)
        expert = jnp.argmax(logits, -1)
        order = jnp.argsort(expert)
        sizes = jnp.bincount(expert, length=E).astype(jnp.int32)
        wi = self.param("wi", init, (E, D, F))
        wout = self.param("wo", init, (E, F, D))
        xs = tokens[order]
        if self.recipe is None:
            y = jax.lax.ragged_dot(jax.nn.gelu(jax.lax.ragged_dot(xs, wi, sizes)), wout, sizes)
        else:
            hid = fp8.ragged_dot(xs, wi, sizes, self.recipe)
            y = fp8.ragged_dot(jax.nn.gelu(hid), wout, sizes, self.recipe)
        gate = jax.nn.sigmoid(jnp.take_along_axis(logits, expert[:, None], -1))
        y = jnp.zeros_like(y).at[order].set(y) * gate
        return x + y.reshape(x.shape), None


class Decoder(nn.Module):
    recipe: str | None = None

    @nn.compact
    def __call__(self, x):
        layers = nn.scan(DecoderLayer, variable_axes={"params": 0}, split_rngs={"params": True},
                         length=LAYERS)(recipe=self.recipe, name="layers")
        x, _ = layers(x, None)
        return x


class Model(nn.Module):
    recipe: str | None = None

    @nn.compact
    def __call__(self, x):
        return Decoder(self.recipe, name="decoder")(x)


X = jax.random.normal(jax.random.key(1), (2, 32, D), jnp.float32)


def _provider(recipe):
    # MaxText's rules match "decoder/.*layers.*"; the router stays in f32, as MaxText keeps it.
    return FmtkitProvider([FmtkitRule(module_path="decoder/layers/router"),
                           FmtkitRule(module_path="decoder/.*layers.*", recipe=recipe)])


@pytest.mark.parametrize("recipe", ["current", "blockwise"])
def test_maxtext_shaped_decoder_equals_fmtkit_wired_by_hand(recipe):
    params = Model().init(jax.random.key(0), X)

    def vg(model):
        return jax.jit(jax.value_and_grad(lambda p: jnp.mean(jnp.square(model.apply(p, X)))))(
            params)

    got = vg(qwix.quantize_model(Model(), _provider(recipe)))
    want = vg(Model(recipe))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert not np.array_equal(got[0], vg(Model())[0])  # the recipe ran


def test_maxtext_shaped_decoder_runs_fp8_in_all_three_gemms():
    params = Model().init(jax.random.key(0), X)
    model = qwix.quantize_model(Model(), _provider("blockwise"))

    def step(p, x, ct):
        value, pullback = jax.vjp(lambda q, x: jnp.mean(jnp.square(model.apply(q, x))), p, x)
        return value, pullback(ct)

    closed = jax.make_jaxpr(step)(params, X, jnp.float32(1))
    n = len(jax.tree.leaves(params))
    records, outs = label_eqns(closed, [{PARAM}] * n + [{DATA}, {COTANGENT}])
    grads = frozenset().union(*outs[1:1 + n])
    fp8s = fp8_operands(closed)
    roles = {}
    for rec in records:
        if id(rec.eqn) not in fp8s:
            continue
        lhs, rhs, eqn = fp8s[id(rec.eqn)]
        role = matmul_role(rec, -1, grads)
        if eqn.primitive.name == "dot_general" and any(
                E in v.aval.shape for v in eqn.invars[:2]):  # the router: as written
            assert not (lhs or rhs), eqn
            continue
        if role in ("fwd", "dgrad", "wgrad"):
            roles.setdefault((eqn.primitive.name, role), []).append(lhs and rhs)
    assert set(roles) == {(p, r) for p in ("dot_general", "ragged_dot_general")
                          for r in ("fwd", "dgrad", "wgrad")}, roles
    assert all(all(v) for v in roles.values()), roles
