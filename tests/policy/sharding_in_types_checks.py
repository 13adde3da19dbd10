"""Runs in a subprocess with 4 simulated CPU devices; prints one JSON line of results.

Sharding-in-types constructs inside a policied model on an ``AxisType.Explicit`` mesh:
``jax.sharding.auto_axes``, ``reshard``, ``explicit_axes``, ``set_mesh`` entered inside the
model, and a Qwen3-style MoE written as JAX's own LLM examples write one (attention and the
router's counts under ``auto_axes``, routing through ``reshard``, the experts'
``lax.ragged_dot`` GEMMs in ``shard_map`` over an expert axis). See
test_sharding_in_types.py for the assertions.
"""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")  # tests/child_env.py's
                           + " --xla_force_host_platform_device_count=4"
                           " --xla_allow_excess_precision=false")

import contextlib
import functools
import json
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from fmtkit import fp8, with_policy

warnings.simplefilter("error")
jax.config.update("jax_numpy_rank_promotion", "raise")

MESH = jax.make_mesh((2, 2), ("data", "expert"), axis_types=(AxisType.Explicit,) * 2)
RESULTS: dict = {}


def check(name):
    """Records ``fn()``'s result under ``name``, or the error it raised (type and text)."""
    def wrap(fn):
        try:
            RESULTS[name] = fn()
        except Exception as err:  # (the test reads the text)
            RESULTS[name] = f"ERROR {type(err).__name__}: {str(err)[:300]}"
        return fn
    return wrap


# ---------------------------------------------------------------------------------------
# Ten-line programs: one construct each, "fp32" and "bf16-mixed".

def with_auto_axes(p, x):
    h = x @ p["w"]
    counts = jax.sharding.auto_axes(lambda h: jnp.sum((h > 0).astype(h.dtype), axis=-1),
                                    out_sharding=P("data"))(h)
    return h * counts[:, None]


def with_reshard(p, x):
    h = jax.sharding.reshard(x @ p["w"], P(None, "expert"))
    return jnp.tanh(h) @ p["o"]


def with_explicit_axes(p, x):
    """On a mesh of Auto axes (the caller's): a region made explicit (the inverse of
    auto_axes; JAX 0.11 has no public mesh_cast, which auto_axes and explicit_axes wrap)."""
    h = x @ p["w"]
    h = jax.sharding.explicit_axes(lambda h: jnp.tanh(h) * h, in_sharding=P("data"))(h)
    return h @ p["o"]


def with_set_mesh_inside(p, x):
    with jax.set_mesh(MESH):
        h = jax.sharding.reshard(x, P("data")) @ p["w"]
        return jnp.tanh(h) @ p["o"]


_RNG = np.random.default_rng(1)
SMALL = {"w": _RNG.standard_normal((8, 8)).astype(np.float32),
         "o": _RNG.standard_normal((8, 4)).astype(np.float32)}
SMALL_X = _RNG.standard_normal((4, 8)).astype(np.float32)
AUTO_MESH = jax.make_mesh((2, 2), ("data", "expert"), axis_types=(AxisType.Auto,) * 2)


def _grads(fn, p, x):
    return jax.jit(jax.value_and_grad(lambda p, x: jnp.sum(fn(p, x).astype(jnp.float32))))(p, x)


def _bitwise(a, b) -> bool:
    return all(np.array_equal(np.asarray(u), np.asarray(v))
               for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


for name, fn, mesh in (("auto_axes", with_auto_axes, MESH), ("reshard", with_reshard, MESH),
                       ("explicit_axes", with_explicit_axes, AUTO_MESH)):
    def run(fn=fn, mesh=mesh):
        with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
            p = SMALL if mesh is None else jax.tree.map(lambda a: jax.device_put(a, P()), SMALL)
            x = SMALL_X if mesh is None else jax.device_put(SMALL_X, P("data"))
            ref = _grads(fn, p, x)
            fp32 = _grads(with_policy(fn, "fp32"), p, x)
            bf16 = _grads(with_policy(fn, "bf16-mixed"), p, x)
        rel = float(abs(bf16[0] - ref[0]) / abs(ref[0]))
        return {"fp32_bitwise": _bitwise(fp32, ref), "bf16_rel": rel}
    check(name)(run)


@check("set_mesh_inside")
def _():
    """jax.set_mesh inside the model runs eagerly only (JAX refuses it in any trace, jit
    included): the policied call, which traces, says so and where to enter the mesh."""
    eager = with_set_mesh_inside(SMALL, SMALL_X)
    try:
        with_policy(with_set_mesh_inside, "bf16-mixed")(SMALL, SMALL_X)
    except ValueError as err:
        return {"eager_ok": eager.shape == (4, 4), "error": str(err)}
    return {"eager_ok": eager.shape == (4, 4), "error": None}


# ---------------------------------------------------------------------------------------
# A Qwen3-style MoE in pure JAX on the explicit mesh (one layer; shapes to 128 so the
# blockwise recipe's 1x128 / 128x128 tiles apply).

V, D, H, DH, E, F, K = 128, 128, 2, 64, 4, 128, 2  # vocab, width, heads, head dim, experts,
B, T = 4, 8                                       # expert width, experts per token; batch


def init(key):
    ks = jax.random.split(key, 9)

    def n(k, shape, fan):
        return jax.random.normal(k, shape, jnp.float32) / np.sqrt(fan)

    return {
        "embed": n(ks[0], (V, D), D),  # tied: unit-variance logits at the start
        "q": n(ks[1], (D, H, DH), D), "k": n(ks[2], (D, H, DH), D),
        "v": n(ks[3], (D, H, DH), D), "o": n(ks[4], (H, DH, D), H * DH),
        "router": n(ks[5], (D, E), D),
        "we_gate": n(ks[6], (E, D, F), D), "we_up": n(ks[7], (E, D, F), D),
        "we_down": n(ks[8], (E, F, D), F),
        "attn_gamma": jnp.ones((D,)), "ffn_gamma": jnp.ones((D,)), "final_gamma": jnp.ones((D,)),
    }


SPECS = {"embed": P(), "q": P(), "k": P(), "v": P(), "o": P(), "router": P(),
         "we_gate": P(None, None, "data"), "we_up": P(None, None, "data"),
         "we_down": P(None, "data", None),  # stored sharded over "data", resharded for use
         "attn_gamma": P(), "ffn_gamma": P(), "final_gamma": P()}


def rms_norm(x, gamma):
    rms = jnp.sqrt(jnp.mean(x.astype(jnp.float32) ** 2, axis=-1, keepdims=True) + 1e-6)
    return (x / rms * gamma[None, None, :]).astype(x.dtype)


@functools.partial(jax.sharding.auto_axes, out_sharding=P("data", None, None, None))
def attention(q, k, v):
    t = q.shape[1]
    qk = jnp.einsum("bthd,bshd->bhts", q, k) * DH ** -0.5
    mask = jnp.tril(jnp.ones((t, t), bool))
    qk = jnp.where(mask, qk, -1e30)
    attn = jax.nn.softmax(qk.astype(jnp.float32), axis=-1).astype(v.dtype)
    return jnp.einsum("bhts,bshd->bthd", attn, v)


def route(x, w_router):
    """The router as JAX's LLM examples write it: tokens resharded, top-k of a softmax."""
    x = jax.sharding.reshard(x.reshape(-1, D), P(None, None))
    scores = jnp.einsum("Sd,de->Se", x, w_router)
    weights, idx = jax.lax.top_k(jax.nn.softmax(scores.astype(jnp.float32), axis=-1), K)
    return weights / jnp.sum(weights, axis=-1, keepdims=True), idx


def experts(x, we_gate, we_up, we_down, weights, idx):
    """Routed experts in shard_map over the expert axis: each device sorts the (token, k)
    pairs routed to its experts and runs them as grouped GEMMs (lax.ragged_dot)."""
    per = E // MESH.shape["expert"]

    @functools.partial(jax.shard_map, mesh=MESH,
                       in_specs=(P(), P("expert"), P("expert"), P("expert"), P(), P()),
                       out_specs=P(), check_vma=False)
    def run(x, we_gate, we_up, we_down, weights, idx):
        first = jax.lax.axis_index("expert") * per
        flat = idx.reshape(-1)
        mine = (flat >= first) & (flat < first + per)
        local = jnp.where(mine, flat - first, per)  # others sort last
        order = jnp.argsort(local)
        xs = x[order // K]
        sizes = jnp.bincount(local, length=per + 1)[:per].astype(jnp.int32)
        gate = jax.nn.silu(jax.lax.ragged_dot(xs, we_gate, sizes))
        up = jax.lax.ragged_dot(xs, we_up, sizes)
        out = jax.lax.ragged_dot(gate * up, we_down, sizes)
        out = jnp.where(mine[order][:, None], out, 0) * weights.reshape(-1)[order][:, None]
        out = out[jnp.argsort(order)].reshape(-1, K, D).sum(axis=1)  # unpermute, sum top-k
        return jax.lax.psum(out, "expert")

    return run(x, we_gate, we_up, we_down, weights, idx)


def qwen3_moe(p, tokens):
    x = p["embed"].at[tokens].get(out_sharding=P("data", None, None))
    h = rms_norm(x, p["attn_gamma"])
    q, k, v = (jnp.einsum("btd,dhk->bthk", h, p[n]) for n in "qkv")
    x = x + jnp.einsum("bthk,hkd->btd", attention(q, k, v), p["o"],
                       out_sharding=P("data", None, None))
    h = rms_norm(x, p["ffn_gamma"])
    weights, idx = route(h, p["router"])
    # the expert weights resharded onto the expert axis, as JAX's examples do before shard_map
    we = [jax.sharding.reshard(p[n], P("expert", None, None))
          for n in ("we_gate", "we_up", "we_down")]
    ff = experts(jax.sharding.reshard(h.reshape(-1, D), P()), *we, weights, idx)
    x = x + jax.sharding.reshard(ff.reshape(B, T, D), P("data", None, None))
    return jnp.einsum("btd,vd->btv", rms_norm(x, p["final_gamma"]), p["embed"])


def loss_fn(model, p, tokens):
    logits = model(p, tokens).astype(jnp.float32)
    labels = jnp.roll(tokens, -1, axis=1)
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, labels[..., None], axis=-1))


def train(model, p, tokens, steps=4, lr=0.5):
    step = jax.jit(lambda p: jax.value_and_grad(functools.partial(loss_fn, model))(p, tokens))
    losses = []
    for _ in range(steps):
        loss, g = step(p)
        losses.append(float(loss))
        p = jax.tree.map(lambda a, b: a - lr * b, p, g)
    return losses, step


def fp8_ragged_gemms(model, p, tokens) -> dict:
    """The ragged_dot GEMMs and dot_generals of the training step, by operand formats."""
    closed = jax.make_jaxpr(jax.grad(functools.partial(loss_fn, model)))(p, tokens)
    counts: dict = {}

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name in ("ragged_dot_general", "dot_general"):
                found = re.findall(re.escape(fp8.WIDENED_SCOPE) + r"-(\w+)-(\w+)",
                                   str(eqn.source_info.name_stack))
                dts = found[-1] if found else tuple(str(v.aval.dtype) for v in eqn.invars[:2])
                key = f"{eqn.primitive.name}:{dts[0]}x{dts[1]}"
                counts[key] = counts.get(key, 0) + 1
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                walk(getattr(sub, "jaxpr", sub))

    walk(closed.jaxpr)
    return counts


with jax.set_mesh(MESH):
    PARAMS = {k: jax.device_put(v, SPECS[k]) for k, v in init(jax.random.key(0)).items()}
    TOKENS = jax.device_put(jnp.asarray(np.random.default_rng(0).integers(0, V, (B, T)),
                                        jnp.int32), P("data"))

    @check("moe_unwrapped")
    def _():
        losses, step = train(qwen3_moe, PARAMS, TOKENS)
        RESULTS["moe_ref_grads"] = step(PARAMS)
        return losses

    @check("moe_fp32")
    def _():
        ref = RESULTS.pop("moe_ref_grads")
        losses, step = train(with_policy(qwen3_moe, "fp32"), PARAMS, TOKENS)
        return {"losses": losses, "bitwise": _bitwise(step(PARAMS), ref)}

    for preset in ("bf16-mixed", "fp8-current", "fp8-blockwise"):
        def run(preset=preset):
            with warnings.catch_warnings():
                # (fp8-blockwise pads no dimension here; a warning would fail the check)
                model = with_policy(qwen3_moe, preset)
                losses, _ = train(model, PARAMS, TOKENS)
                return {"losses": losses, "gemms": fp8_ragged_gemms(model, PARAMS, TOKENS)}
        check(f"moe_{preset}")(run)

print(json.dumps(RESULTS, default=str))
