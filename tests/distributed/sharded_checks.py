"""Runs in a subprocess with 8 simulated CPU devices; prints one JSON line of results.

Each check compares a sharded computation with the single-device one on the same global
batch (see test_sharding.py for the assertions).
"""

import os

os.environ["XLA_FLAGS"] = ("--xla_force_host_platform_device_count=8 "
                           "--xla_allow_excess_precision=false")

import dataclasses
import functools
import json
import re
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from fmtkit import DelayedScalingState, fp8, optim, with_policy
from fmtkit.distributed import reduce_gradients

warnings.simplefilter("error")
jax.config.update("jax_numpy_rank_promotion", "raise")

MESH = Mesh(np.array(jax.devices()), ("data",))
REPL = NamedSharding(MESH, P())
BATCH = NamedSharding(MESH, P("data"))


class Mlp(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(128, name="fc1")(x))
        return nn.Dense(16, name="fc2")(x)


# bf16 params with f32 masters in the optimizer. The matmuls run in f32 here so that sharded
# and single-device gradients can agree to f32 round-off: with bf16 compute each device's
# partial weight gradient is rounded to bf16 before the cross-device sum (see
# check_bf16_mixed_gradients for that case).
MODEL = with_policy(Mlp(), "p=bf16,c=f32,o=f32")
OPT = optim.dynamic_loss_scale(optim.master_weights(optim.adamw(1e-2)), init_scale=2.0**10)


_HEADER = re.compile(r"^(?:ENTRY\s+)?(%[\w.\-]+)\s")
_BRANCH = re.compile(r"(?:branch_computations=\{([^}]*)\}|"
                     r"(?:true|false)_computation=(%[\w.\-]+))")
_ALL_REDUCE = re.compile(r"=\s*(.*?)\s+all-reduce(?:-start)?\(")
_ARRAY = re.compile(r"\b(pred|[a-z]+\d+)\[([\d,]*)\]")


def all_reduces(hlo_text: str) -> tuple[int, int]:
    """(count, bytes) of the all-reduce instructions of compiled HLO text that run every step.

    An all-reduce of a tuple counts once, with all its operands' bytes. Those inside a
    conditional's branches are left out: delayed FP8's bootstrap (current amax, taken only
    while the history is empty) is one. Read from HLO's text form: a computation starts with
    an unindented ``[ENTRY] %name (...)`` line, its instructions are indented, and an
    instruction reads ``%name = <result type> all-reduce(...)``.
    """
    branches = {name.strip() for m in _BRANCH.finditer(hlo_text)
                for name in (m.group(1) or m.group(2)).split(",")}
    count = nbytes = 0
    current = None
    for line in hlo_text.splitlines():
        if not line.startswith(" "):
            header = _HEADER.match(line)
            current = header.group(1) if header else current
            continue
        m = _ALL_REDUCE.search(line)
        if m is None or current in branches:
            continue
        count += 1
        for dtype, dims in _ARRAY.findall(m.group(1)):
            bits = 8 if dtype == "pred" else int(re.sub(r"\D", "", dtype))
            nbytes += int(np.prod([int(d) for d in dims.split(",") if d])) * bits // 8
    return count, nbytes


def _data(seed=0, n=64):
    rng = np.random.default_rng(seed)
    return (jnp.asarray(rng.standard_normal((n, 32)), jnp.float32),
            jnp.asarray(rng.standard_normal((n, 16)), jnp.float32))


def _loss(params, x, y):
    return jnp.mean((MODEL.apply({"params": params}, x) - y) ** 2)


def _step(params, state, x, y, grads_fn):
    scale = optim.loss_scale(state)
    grads = grads_fn(lambda p: _loss(p, x, y) * scale.astype(jnp.float32), params)
    updates, state = OPT.update(grads, state, params)
    return optim.add_updates(params, updates), state


def _masters(state):
    return [np.asarray(m, np.float64) for m in jax.tree.leaves(state.inner_state.master)]


def check_data_parallel():
    x, y = _data()
    params = MODEL.init(jax.random.key(0), x)["params"]
    state = OPT.init(params)
    step = jax.jit(lambda p, s, x, y: _step(p, s, x, y, lambda f, p: jax.grad(f)(p)))
    _, s1 = step(params, state, x, y)
    _, s8 = step(jax.device_put(params, REPL), jax.device_put(state, REPL),
                  jax.device_put(x, BATCH), jax.device_put(y, BATCH))
    m1, m8 = _masters(s1), _masters(s8)
    return {"jit_master_max_rel": max(float(np.max(np.abs(a - b)) / np.max(np.abs(a)))
                                      for a, b in zip(m1, m8))}


def _shard_map_step(poison_device=None):
    x, y = _data()
    if poison_device is not None:
        x = x.at[poison_device * 8].set(jnp.inf)  # one row of one device's shard
    params = MODEL.init(jax.random.key(0), _data()[0])["params"]
    state = OPT.init(params)

    def local(p, s, xb, yb):
        def grads_fn(f, p):
            g = jax.grad(f)(p)
            return reduce_gradients(g, "data", dtype="float32")  # mean over devices

        p, s = _step(p, s, xb, yb, grads_fn)
        return p, s, s.skipped_steps[None]

    f = jax.jit(jax.shard_map(local, mesh=MESH, in_specs=(P(), P(), P("data"), P("data")),
                              out_specs=(P(), P(), P("data")), check_vma=False))
    return params, state, f(params, state, x, y)


def check_bf16_mixed_gradients():
    """bf16-mixed: data-parallel gradients equal single-device ones to bf16 rounding."""
    model = with_policy(Mlp(), "bf16-mixed")
    x, y = _data()
    params = model.init(jax.random.key(0), x)["params"]

    def grads(p, x, y):
        return jax.grad(lambda p: jnp.mean((model.apply({"params": p}, x) - y) ** 2))(p)

    g1 = jax.jit(grads)(params, x, y)
    g8 = jax.jit(grads)(jax.device_put(params, REPL), jax.device_put(x, BATCH),
                        jax.device_put(y, BATCH))
    rel = max(float(jnp.linalg.norm(a - b) / jnp.linalg.norm(a))
              for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g8)))
    return {"bf16_mixed_grad_rel": rel,
            "bf16_mixed_grad_dtypes": sorted({str(a.dtype) for a in jax.tree.leaves(g8)})}


def check_shard_map():
    x, y = _data()

    # f32 parameters: their per-device gradients stay f32 up to the reduction. (Gradients of
    # bf16-stored parameters are bf16 on each device before a shard_map reduction, whereas
    # jit's SPMD partitioner reduces the f32 partial sums before the cast.)
    model = with_policy(Mlp(), "fp32")
    params = model.init(jax.random.key(0), x)["params"]

    def grads(p, xb, yb):
        return jax.grad(lambda p: jnp.mean((model.apply({"params": p}, xb) - yb) ** 2))(p)

    g1 = jax.jit(grads)(params, x, y)
    local = jax.shard_map(lambda p, xb, yb: reduce_gradients(grads(p, xb, yb), "data"),
                          mesh=MESH, in_specs=(P(), P("data"), P("data")), out_specs=P(),
                          check_vma=False)
    g8 = jax.jit(local)(params, x, y)
    out = {"shard_map_grad_max_rel": max(float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(a)))
                                         for a, b in zip(jax.tree.leaves(g1),
                                                         jax.tree.leaves(g8)))}
    params, _, (p_bad, s_bad, skipped) = _shard_map_step(poison_device=3)
    out["poisoned_skipped_per_device"] = np.asarray(skipped).tolist()
    out["poisoned_params_unchanged"] = all(
        bool(jnp.array_equal(a, b)) for a, b in zip(jax.tree.leaves(params),
                                                     jax.tree.leaves(p_bad)))
    out["poisoned_scale"] = float(optim.loss_scale(s_bad))
    return out


def check_fp8_delayed():
    model = with_policy(Mlp(), [(".*", "p=f32,c=bf16,o=f32,fp8=delayed")])
    x, y = _data(1)
    v = model.init(jax.random.key(0), x)

    def obs(params, st, x, y):
        def loss(p, s):
            return jnp.mean((model.apply({"params": p, "fp8_state": s}, x) - y) ** 2)

        g = jax.grad(loss, argnums=1)(params, st)
        return fp8.update_state(st, g)

    f = jax.jit(obs)
    sharded = (jax.device_put(v["params"], REPL), jax.device_put(x, BATCH),
               jax.device_put(y, BATCH))
    # Step 1 bootstraps from the current amaxes; step 2 quantizes with the history.
    h1 = f(v["params"], v["fp8_state"], x, y)
    h8 = f(sharded[0], jax.device_put(v["fp8_state"], REPL), *sharded[1:])
    h1b = f(v["params"], h1, x, y)
    h8b = f(sharded[0], h8, *sharded[1:])
    hlo = f.lower(sharded[0], h8, *sharded[1:]).compile().as_text()
    # Two members (seeds) vmapped, one recorded and one empty history: each member's own
    # update, and still one all-reduce for all their observations.
    stacked = jax.tree.map(lambda a, b: jnp.stack([a, b]), h8, v["fp8_state"])
    fv = jax.jit(jax.vmap(obs, in_axes=(None, 0, None, None)))
    hv = fv(sharded[0], jax.device_put(stacked, REPL), *sharded[1:])
    hv_hlo = fv.lower(sharded[0], jax.device_put(stacked, REPL), *sharded[1:]).compile()
    return {"fp8_history_equal": all(bool(jnp.array_equal(a, b)) for a, b in
                                     zip(jax.tree.leaves((h1, h1b)), jax.tree.leaves((h8, h8b)))),
            "fp8_history_nonzero": all(float(a[:, 0].min()) > 0 for a in jax.tree.leaves(h1)),
            "fp8_observations": sum(a[:, 0].size for a in jax.tree.leaves(h1)),
            "fp8_step_all_reduces": all_reduces(hlo),
            "fp8_vmapped_equal": all(bool(jnp.array_equal(a, b)) for a, b in zip(
                jax.tree.leaves(hv), jax.tree.leaves(jax.tree.map(
                    lambda a, b: jnp.stack([a, b]), h8b, h8)))),
            "fp8_vmapped_all_reduces": all_reduces(hv_hlo.as_text())}


def _fp8_vjp(recipe, x, w, ct, hist):
    """y, dx, dw (summed over the mesh when the recipe reduces amaxes: inside shard_map) and
    the observed amaxes of one FP8 dot."""
    dg = fp8.dot_general_fn(recipe)
    y, back = jax.vjp(lambda x, w, s: dg(x, w, (((1,), (0,)), ((), ())),
                                         fp8_state=s if recipe.delayed else None),
                      x, w, DelayedScalingState(hist))
    dx, dw, ds = back(ct)
    if recipe.amax_reduce_axes:
        dw = jax.lax.psum(dw, recipe.amax_reduce_axes)
    return y, dx, dw, ds.amax_history


def check_fp8_amax_reduce_axes():
    """A delayed and a current per-tensor FP8 dot inside ``shard_map`` on a batch shard, with
    ``amax_reduce_axes``: every device quantizes with the global amax (the bootstrap's is
    taken inside a ``lax.cond`` branch), so the observed amaxes equal the single-device
    dot's exactly and y, dx, dw agree to f32 rounding (XLA's GEMM summation order changes
    with the shard's shape; dw sums 8 partial products)."""
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((64, 96)) * np.exp(rng.uniform(-4, 4, (64, 1))),
                    jnp.float32)  # rows of very different sizes: local amaxes differ
    w = jnp.asarray(rng.standard_normal((96, 40)), jnp.float32)
    ct = jnp.asarray(rng.standard_normal((64, 40)), jnp.float32)
    out = {}
    for name in ("delayed", "current"):
        base = fp8.get_recipe(name)
        recipes = {"single": base,
                   "sharded": dataclasses.replace(base, amax_reduce_axes=("data",))}
        hist0 = fp8.init_state(base).amax_history
        # an empty history (bootstrap) and one recorded step (the history's amax)
        for hist_name, hist in (("empty", hist0), ("recorded", hist0.at[:, 0].set(
                jnp.asarray([50.0, 3.0, 9.0])))):
            want = jax.jit(functools.partial(_fp8_vjp, recipes["single"]))(x, w, ct, hist)
            got = jax.jit(jax.shard_map(functools.partial(_fp8_vjp, recipes["sharded"]),
                                        mesh=MESH, in_specs=(P("data"), P(), P("data"), P()),
                                        out_specs=(P("data"), P("data"), P(), P()),
                                        check_vma=False))(x, w, ct, hist)
            key = f"fp8_reduce_axes_{name}_{hist_name}"
            out[key + "_obs_exact"] = bool(jnp.array_equal(want[3], got[3]))
            for i, part in ((0, "y"), (1, "dx"), (2, "dw")):
                out[f"{key}_{part}_rel"] = float(jnp.max(jnp.abs(got[i] - want[i]))
                                                 / jnp.max(jnp.abs(want[i])))
    return out


def check_fsdp():
    x, y = _data()
    params = MODEL.init(jax.random.key(0), x)["params"]
    shard = jax.tree.map(lambda p: NamedSharding(MESH, P("data") if p.ndim == 2 else P()), params)
    params = jax.device_put(params, shard)
    state = OPT.init(params)
    step = jax.jit(lambda p, s, x, y: _step(p, s, x, y, lambda f, p: jax.grad(f)(p)))
    p2, s2 = step(params, state, jax.device_put(x, BATCH), jax.device_put(y, BATCH))
    kept = all(a.sharding.is_equivalent_to(b.sharding, a.ndim)
               for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(p2)))
    masters = all(m.sharding.is_equivalent_to(p.sharding, p.ndim) for m, p in
                  zip(jax.tree.leaves(s2.inner_state.master), jax.tree.leaves(params)))
    return {"fsdp_param_sharding_kept": kept, "fsdp_master_sharding_matches": masters}


def check_reduction_precision():
    rng = np.random.default_rng(7)
    # Gradients of mixed magnitudes, as different devices' shards produce.
    g = rng.standard_normal((8, 4096)) * np.exp(rng.uniform(-3, 3, (8, 1)))
    exact = g.sum(axis=0)
    gj = jnp.asarray(g, jnp.float32)

    def reduce(mode):
        def local(v):
            v = v[0]
            if mode == "bf16":
                return reduce_gradients(v, "data", dtype="bf16", mean=False)[None]
            if mode == "bf16-comm":
                return reduce_gradients(v, "data", dtype="f32", comm_dtype="bf16",
                                        mean=False)[None]
            return reduce_gradients(v, "data", dtype="f32", mean=False)[None]

        f = jax.jit(jax.shard_map(local, mesh=MESH, in_specs=P("data"), out_specs=P("data"),
                                  check_vma=False))
        out = np.asarray(f(gj), np.float64)[0]
        return float(np.linalg.norm(out - exact) / np.linalg.norm(exact))

    return {f"reduce_err_{m}": reduce(m) for m in ("f32", "bf16-comm", "bf16")}


if __name__ == "__main__":
    assert jax.device_count() == 8, jax.devices()
    results = {}
    for check in (check_data_parallel, check_bf16_mixed_gradients, check_shard_map,
                  check_fp8_delayed, check_fp8_amax_reduce_axes, check_fsdp,
                  check_reduction_precision):
        results.update(check())
    print(json.dumps(results))
