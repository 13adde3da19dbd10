"""Benchmark: the training step of a DeepSeek-style fine-grained MoE layer in bf16 and FP8.

    fmtkit bench moe-step [--experts 8,64] [--tokens 8192] [--d-model 2048] [--ffn 1536]
                          [--top-k 2,6] [--repeats 20] [--out DIR]

The layer (``moe_layer``): a softmax router with top-k routing, tokens sorted by expert, a
fused gate/up projection ``[E, D, 2F]`` and a down projection ``[E, F, D]`` as grouped GEMMs
(``lax.ragged_dot``), SiLU-gated, weighted by the router and scattered back, plus one
shared expert (a dense SwiGLU of the same width), a residual, an MSE loss, SGD. Variants,
each ``jax.jit`` of loss + gradient + update, timed in alternation after warm-up
(``block_until_ready`` before the clock; medians):

* ``bf16-xla``: ``with_policy(layer, "bf16-mixed")``: XLA's ``ragged_dot`` in bf16;
* ``bf16-tokamax``: the same layer in bf16 with ``tokamax.ragged_dot`` (its Pallas Mosaic
  GPU grouped GEMM) for the experts, when tokamax is importable (pin it: ``pip install
  tokamax==0.0.17``); otherwise reported as unavailable with the reason;
* ``fp8-current`` and ``fp8-blockwise``: ``with_policy(layer, "fp8-current" /
  "fp8-blockwise")``: ``fmtkit.fp8.ragged_dot``, on a Hopper GPU through the grouped
  Pallas kernels for blockwise (``pallas_kernels``, registered on import).

Printed: steps/s per variant and model, then the ratios fp8-blockwise / bf16-xla and
fp8-blockwise / bf16-tokamax, last. Target on an H200: fp8-blockwise >= 1.2x bf16-mixed's
steps/s. Results: runs/bench-moe-step/results.json. GPU-only: without a GPU it says so
and exits 0.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

import pallas_kernels  # noqa: F401  registers the grouped kernels as fmtkit.fp8's backend
from studies.lib.common import write_bench_results
from studies.lib.timing import time_interleaved

# How the command line lists this benchmark (studies.app.registry).
NAME = "moe-step"
SUMMARY = "an MoE layer's train step in bf16 and FP8 (grouped GEMMs; GPU only)"

__all__ = ["TARGET", "init_params", "main", "make_step", "moe_layer"]

TARGET = 1.2
"""fp8-blockwise's steps/s over bf16-mixed's (XLA's ragged_dot) on an H200."""
VARIANTS = ("bf16-xla", "bf16-tokamax", "fp8-current", "fp8-blockwise")


def init_params(key: jax.Array, experts: int, d: int, f: int) -> dict[str, jax.Array]:
    """f32 parameters: router [D, E], experts' gate/up [E, D, 2F] and down [E, F, D], the
    shared expert's gate/up [D, 2F] and down [F, D] (fan-in scaled normals)."""
    ks = jax.random.split(key, 5)

    def normal(k, shape, fan_in):
        return jax.random.normal(k, shape, jnp.float32) / jnp.sqrt(jnp.float32(fan_in))

    return {"router": normal(ks[0], (d, experts), d),
            "up": normal(ks[1], (experts, d, 2 * f), d),
            "down": normal(ks[2], (experts, f, d), f),
            "shared_up": normal(ks[3], (d, 2 * f), d),
            "shared_down": normal(ks[4], (f, d), f)}


def moe_layer(params: dict[str, jax.Array], x: jax.Array, *, top_k: int,
              ragged: Callable[..., jax.Array] = jax.lax.ragged_dot) -> jax.Array:
    """``x [T, D]`` -> ``[T, D]``: top-k routed experts (grouped GEMMs through ``ragged``,
    ``lax.ragged_dot``'s signature) plus a shared expert, with a residual."""
    t, d = x.shape
    experts = params["router"].shape[1]
    probs = jax.nn.softmax(jnp.dot(x, params["router"]).astype(jnp.float32), axis=-1)
    weight, idx = jax.lax.top_k(probs, top_k)  # [T, k]
    flat = idx.reshape(-1)
    order = jnp.argsort(flat)
    token = order // top_k  # the token of each sorted row
    # tokens per expert (a comparison and a sum: bincount's scatter-add would hold a body
    # the policy runs as traced)
    sizes = jnp.sum(flat[:, None] == jnp.arange(experts)[None, :], axis=0, dtype=jnp.int32)
    h = ragged(x[token], params["up"], sizes)  # [T*k, 2F], sorted by expert
    gate, up = jnp.split(h, 2, axis=-1)
    y = ragged(jax.nn.silu(gate) * up, params["down"], sizes)  # [T*k, D]
    # Back to token order (a gather by the inverse permutation, no scatter), weighted.
    y = y[jnp.argsort(order)].reshape(t, top_k, d)
    routed = jnp.sum(y * weight[:, :, None].astype(y.dtype), axis=1)
    gate, up = jnp.split(jnp.dot(x, params["shared_up"]), 2, axis=-1)
    shared = jnp.dot(jax.nn.silu(gate) * up, params["shared_down"])
    return x + routed.astype(x.dtype) + shared.astype(x.dtype)


def _tokamax_ragged():
    """``tokamax.ragged_dot`` with ``lax.ragged_dot``'s positional signature, or the reason
    it cannot run."""
    try:
        import tokamax
    except ImportError as e:
        return None, f"tokamax not importable ({e}); pip install tokamax==0.0.17"
    return (lambda lhs, rhs, sizes: tokamax.ragged_dot(lhs, rhs, sizes)), None


def make_step(variant: str, top_k: int, lr: float = 1e-2):
    """The jitted train step ``(params, x, target) -> (params, loss)`` of ``variant``
    (``VARIANTS``), or (None, reason) when it cannot run here."""
    from fmtkit.policy import with_policy

    if variant == "bf16-tokamax":
        ragged, why = _tokamax_ragged()
        if ragged is None:
            return None, why

        def model(p, x):
            p16 = jax.tree.map(lambda v: v.astype(jnp.bfloat16), p)
            return moe_layer(p16, x.astype(jnp.bfloat16), top_k=top_k, ragged=ragged)
    else:
        preset = "bf16-mixed" if variant == "bf16-xla" else variant
        model = with_policy(lambda p, x: moe_layer(p, x, top_k=top_k), preset)

    def loss_fn(p, x, target):
        return jnp.mean(jnp.square(model(p, x).astype(jnp.float32) - target))

    @jax.jit
    def step(p, x, target):
        loss, g = jax.value_and_grad(loss_fn)(p, x, target)
        return jax.tree.map(lambda a, b: a - lr * b, p, g), loss

    return step, None


def _ints(text: str, name: str) -> list[int]:
    try:
        vals = [int(v) for v in text.split(",")]
    except ValueError:
        vals = []
    if not vals or any(v <= 0 for v in vals):
        raise SystemExit(f"fmtkit bench moe-step: {name} must be positive integers, got "
                         f"{text!r}")
    return vals


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="fmtkit bench moe-step", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--experts", default="8,64", help="comma-separated expert counts")
    p.add_argument("--top-k", default="2,6", help="top-k per expert count")
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--d-model", type=int, default=2048)
    p.add_argument("--ffn", type=int, default=1536, help="each expert's hidden width")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--out", default=None, help="output folder (default runs/bench-moe-step)")
    args = p.parse_args(argv)
    experts, top_ks = _ints(args.experts, "--experts"), _ints(args.top_k, "--top-k")
    if len(experts) != len(top_ks):
        p.error("--experts and --top-k must have the same number of entries")
    if jax.default_backend() != "gpu":
        print(f"moe-step: no GPU present (backend: {jax.default_backend()}); this benchmark "
              "times grouped GEMMs on a GPU, nothing to do.")
        return 0
    rows: list[dict[str, Any]] = []
    for e, k in zip(experts, top_ks):
        key = jax.random.key(0)
        params = init_params(key, e, args.d_model, args.ffn)
        x = jax.random.normal(jax.random.key(1), (args.tokens, args.d_model), jnp.float32)
        target = jax.random.normal(jax.random.key(2), x.shape, jnp.float32)
        fns, skipped = {}, {}
        for variant in VARIANTS:
            step, why = make_step(variant, k)
            if step is None:
                skipped[variant] = why
                continue
            try:
                jax.block_until_ready(step(params, x, target))
            except Exception as err:  # a kernel or library that cannot run here: say why
                skipped[variant] = f"{type(err).__name__}: {err}"[:500]
                continue
            fns[variant] = lambda step=step, a=(params, x, target): step(*a)
        times = time_interleaved(fns, repeats=args.repeats)
        steps = {v: 1.0 / t for v, t in times.items()}
        row = {"experts": e, "top_k": k, "steps_per_s": steps, "skipped": skipped}
        for base in ("bf16-xla", "bf16-tokamax"):
            if "fp8-blockwise" in steps and base in steps:
                row[f"fp8_blockwise_over_{base}"] = steps["fp8-blockwise"] / steps[base]
        rows.append(row)
        cells = "  ".join(f"{v} {s:7.2f}" for v, s in steps.items())
        print(f"E={e} top-{k}: steps/s  {cells}", flush=True)
        for v, why in skipped.items():
            print(f"  {v}: not run ({why})")
    file = write_bench_results("moe-step", {"config": vars(args), "target": TARGET,
                                      "results": rows}, args.out)
    print(f"wrote {file}")
    for r in rows:
        ratios = "  ".join(f"{k_} {v:.2f}x" for k_, v in r.items() if k_.startswith("fp8_"))
        print(f"ratio E={r['experts']}: {ratios or 'n/a'} (target >= {TARGET}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
