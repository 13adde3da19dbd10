"""Benchmark: a train step under ``with_policy(model, "bf16-mixed")`` vs the same model
written by hand in mixed precision.

    fmtkit bench policy [--api linen|nnx] [--model transformer|einsum] [--d-model 128]
                        [--layers 2] [--seq 64] [--batch 8] [--trace-layers 12]

``--model einsum`` (linen) is a gemma-style model: ``nn.Einsum`` q/k/v/out projections,
attention written by hand (``jnp.einsum`` + ``jax.nn.softmax``), an RMSNorm written by hand;
its baseline casts by hand (bf16 activations, f32 norm statistics, softmax and logits).
``--trace-layers N`` also measures the policy's own overhead on an N-layer model, wrapped
(``bf16-mixed``) vs unwrapped f32 and vs its hand-cast bf16 twin, all in one run: tracing
(``jit(...).lower``) and compiling the train step (targets: trace <= 1.3x,
compile unchanged), in alternation, a fresh ``jit`` per round; the policied model's first
trace (a newly wrapped model) and its re-trace (a fresh ``jit`` of the same policied model,
which reuses the model's jaxpr kept per input signature); the equations of the traced step
(all depths) and its ``round_cotangent`` calls; the compiled HLO's instructions, converts
and fusions; and an eager (un-jitted) ``apply``, which a policied model compiles once per
input signature.

The model is ``studies.lib.models.TransformerLM`` (or ``NnxTransformerLM``). The baseline is the
same class configured by hand the way a user writes mixed precision with Flax's own knobs:
``dtype=bfloat16, param_dtype=float32``, norms and router with ``dtype=float32``, logits cast
to f32 (linen: attention softmax in f32 too, as the policy does). The policied model is the
unmodified f32 model wrapped by ``with_policy``. Both steps are ``jax.jit`` of loss + grad +
SGD update on the same parameters and tokens, timed in alternation after warm-up (median).
Printed: both step times, both compiled-HLO instruction counts, compile times, then the ratio
(target: at most 1.05x).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import statistics
import time

import flax.linen as nn
import jax
import jax.extend.core
import jax.numpy as jnp
from flax import nnx

from fmtkit.policy import with_policy
from studies.lib import models
from studies.lib.common import write_bench_results
from studies.lib.timing import time_fn, time_interleaved

# How the command line lists this benchmark (studies.app.registry).
NAME = "policy"
SUMMARY = "a train step under with_policy(bf16-mixed) vs the model cast by hand"

_INSTR = re.compile(r"^\s*(ROOT\s+)?%?[\w.\-]+ = ", re.MULTILINE)
_OPCODE = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+ = \S+ ([\w\-]+)\(", re.MULTILINE)


def hlo_op_count(compiled) -> int:
    """Instructions in the optimized HLO module (all computations, fusions included)."""
    return len(_INSTR.findall(compiled.as_text()))


def _linen_step(model, lr):
    def step(params, tokens):
        loss, grads = jax.value_and_grad(
            lambda p: models.lm_loss(model.apply({"params": p}, tokens), tokens))(params)
        return jax.tree.map(lambda p, g: p - lr * g, params, grads), loss

    return jax.jit(step)


def _nnx_step(model, lr):
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def step(params, tokens):
        def loss_fn(p):
            return models.lm_loss(nnx.merge(graphdef, p, rest)(tokens), tokens)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        return jax.tree.map(lambda p, g: p - lr * g, params, grads), loss

    return jax.jit(step), params


class EinsumLM(nn.Module):
    """gemma-style LM written the way that codebase writes it (see the module docstring).

    ``dtype=None``: an f32 model (what ``with_policy`` wraps); ``bfloat16``: the same model
    with mixed precision cast by hand, the baseline.
    """

    vocab: int
    d_model: int
    heads: int
    layers: int
    dtype: str | None = None

    @nn.compact
    def __call__(self, tokens):
        dt = jnp.dtype(self.dtype or "float32")
        hd = self.d_model // self.heads
        x = nn.Embed(self.vocab, self.d_model, name="embedder")(tokens).astype(dt)
        for i in range(self.layers):
            h = _rms_norm(x, self.param(f"norm_{i}", nn.initializers.ones, (self.d_model,)), dt)
            q, k, v = (nn.Einsum((self.d_model, self.heads, hd), "btd,dhk->bthk",
                                 use_bias=False, dtype=dt, name=f"{n}_{i}")(h)
                       for n in ("q", "k", "v"))
            s = jnp.einsum("bthk,bshk->bhts", q, k).astype(jnp.float32) * (hd ** -0.5)
            mask = jnp.tril(jnp.ones((s.shape[-1], s.shape[-1]), bool))[None, None]
            p = jax.nn.softmax(jnp.where(mask, s, -1e30), axis=-1).astype(dt)
            o = jnp.einsum("bhts,bshk->bthk", p, v)
            x = x + nn.Einsum((self.heads, hd, self.d_model), "bthk,hkd->btd", use_bias=False,
                              dtype=dt, name=f"out_{i}")(o)
            h = _rms_norm(x, self.param(f"ffn_norm_{i}", nn.initializers.ones,
                                        (self.d_model,)), dt)
            h = jax.nn.gelu(nn.Dense(4 * self.d_model, dtype=dt, name=f"up_{i}")(h))
            x = x + nn.Dense(self.d_model, dtype=dt, name=f"down_{i}")(h)
        return nn.Dense(self.vocab, dtype=dt, name="logitdense")(x).astype(jnp.float32)


def _rms_norm(x, scale, dt):
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-6)
    return (y * scale[None, None, :]).astype(dt)


# The named scope of a cotangent rounding's tangent rule (``fmtkit.policy``'s
# ``round_cotangent``): in a differentiated step only its narrowing convert is left of it.
_GRAD_ROUND_SCOPE = "fmtkit_grad_round_"


def equation_count(closed) -> tuple[int, int]:
    """(equations at every depth, cotangent roundings) of a traced train step: a rounding is
    the narrowing convert in the scope of ``round_cotangent``'s tangent rule."""
    eqns = rounds = 0
    for eqn in closed.jaxpr.eqns:
        eqns += 1
        rounds += (eqn.primitive.name == "convert_element_type"
                   and _GRAD_ROUND_SCOPE in str(eqn.source_info.name_stack)
                   and eqn.outvars[0].aval.dtype.itemsize < eqn.invars[0].aval.dtype.itemsize)
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            e, r = equation_count(sub if hasattr(sub, "jaxpr")
                                  else jax.extend.core.ClosedJaxpr(sub, ()))
            eqns, rounds = eqns + e, rounds + r
    return eqns, rounds


def eager_apply_seconds(model, params, tokens, repeats: int = 5) -> float:
    """Median wall time of an eager (un-jitted) ``model.apply`` after a first call."""
    return time_fn(lambda: model.apply({"params": params}, tokens), repeats=repeats, warmup=1)


def hlo_stats(compiled) -> dict[str, int]:
    """Instructions of the optimized HLO module, and of them converts, fusions, copies."""
    ops = _OPCODE.findall(compiled.as_text())
    return {"instructions": len(ops), "convert": ops.count("convert"),
            "fusion": ops.count("fusion"), "copy": ops.count("copy")}


def trace_overhead(args, cfg, hand_cfg, tokens, lr) -> tuple[dict, dict]:
    """The policy's overhead on an ``--trace-layers``-layer LM: trace and compile of the
    train step, unwrapped (f32), cast by hand (bf16 ``dtype``, the twin of the preset) and
    ``with_policy`` (the preset on the f32 model), in alternation with a fresh ``jit`` each
    round; equations, ``round_cotangent`` calls, compiled-HLO counts and an eager apply."""
    deep = dataclasses.replace(cfg, num_layers=args.trace_layers)
    model = models.TransformerLM(deep)
    params = jax.jit(model.init)(jax.random.key(1), tokens)["params"]
    hand = models.TransformerLM(dataclasses.replace(hand_cfg, num_layers=args.trace_layers))
    kept = with_policy(model, args.trace_preset)  # its traces are kept across rounds
    # A first trace is one of a newly wrapped model (a fresh with_policy each round); a
    # re-trace is a fresh jit of the same policied model (an eval step, a new jit), which
    # reuses the model's jaxpr kept per input signature and only re-interprets it.
    wrapped = {"unwrapped": lambda: model, "hand_written": lambda: hand,
               "with_policy": lambda: with_policy(model, args.trace_preset)}
    # In alternation, a fresh jit per round (the first trace of a process also fills JAX's
    # own caches, so a single ordered measurement favours the later models); round 1 is
    # reported but left out of the medians (it fills the caches of every model). Wall and
    # CPU seconds of this process (tracing is one Python thread: its CPU time hardly moves
    # with the load of other jobs, its wall time does); ratios are medians of the per-round
    # ratios (each round's models ran back to back).
    rounds_s: dict[str, list] = {k: [] for k in (*wrapped, "re-trace")}
    hlo: dict[str, dict] = {}
    clocks = (time.perf_counter, time.process_time)
    for _ in range(args.trace_rounds + 1):
        for k, make in (*wrapped.items(), ("re-trace", lambda: kept)):
            t0 = [c() for c in clocks]
            lowered = _linen_step(make(), lr).lower(params, tokens)
            t1 = [c() for c in clocks]
            if k == "re-trace":  # compiles what the first trace compiles
                rounds_s[k].append((t1[0] - t0[0], t1[1] - t0[1], 0.0, 0.0))
                continue
            compiled = lowered.compile()
            t2 = [c() for c in clocks]
            rounds_s[k].append((t1[0] - t0[0], t1[1] - t0[1], t2[0] - t1[0], t2[1] - t1[1]))
            hlo.setdefault(k, hlo_stats(compiled))
    tracing, overhead = {}, {}
    for k, make in wrapped.items():
        m = make()
        eqns, rounds = equation_count(jax.make_jaxpr(_linen_step(m, lr))(params, tokens))
        overhead[k] = {"equations": eqns, "round_cotangent": rounds, "hlo": hlo[k],
                       "eager_apply_s": eager_apply_seconds(m, params, tokens)}
    for k, rs in rounds_s.items():
        # (trace wall, trace CPU, compile wall, compile CPU), medians; then every round
        tracing[k] = tuple(statistics.median(r[i] for r in rs[1:]) for i in range(4))
        overhead.setdefault(k, {})["rounds_s"] = rs

    def ratio(a: str, b: str, i: int) -> float:
        return statistics.median(x[i] / y[i] for x, y in zip(rounds_s[a][1:], rounds_s[b][1:]))

    def span(k: str, i: int) -> str:
        v = [r[i] for r in rounds_s[k][1:]]
        return f"{statistics.median(v):5.2f} [{min(v):.2f}-{max(v):.2f}]"

    print(f"{args.trace_layers}-layer model under {args.trace_preset}: seconds, median "
          f"[range] of {args.trace_rounds} rounds after a first, wall / CPU (load average "
          f"{os.getloadavg()[0]:.1f}):")
    for k in rounds_s:
        line = f"  {k:<13} trace wall {span(k, 0)}  CPU {span(k, 1)}"
        if k in overhead and "hlo" in overhead[k]:
            o = overhead[k]
            line += (f"   compile wall {span(k, 2)}  CPU {span(k, 3)}   equations "
                     f"{o['equations']} (round_cotangent {o['round_cotangent']})   HLO "
                     f"{o['hlo']['instructions']} (convert {o['hlo']['convert']}, fusion "
                     f"{o['hlo']['fusion']})   eager apply {o['eager_apply_s'] * 1e3:.1f} ms")
        else:
            line += "   (a fresh jit of the same policied model: the kept jaxpr re-interpreted)"
        print(line)
    w, u, h = (overhead[k] for k in ("with_policy", "unwrapped", "hand_written"))
    print(f"ratio with_policy / unwrapped (wall, CPU): first trace "
          f"{ratio('with_policy', 'unwrapped', 0):.2f}x, "
          f"{ratio('with_policy', 'unwrapped', 1):.2f}x (target <= 1.3x); re-trace "
          f"{ratio('re-trace', 'unwrapped', 0):.2f}x, "
          f"{ratio('re-trace', 'unwrapped', 1):.2f}x; compile "
          f"{ratio('with_policy', 'unwrapped', 2):.2f}x, "
          f"{ratio('with_policy', 'unwrapped', 3):.2f}x (target: unchanged); equations "
          f"{w['equations'] / u['equations']:.2f}x; eager apply "
          f"{w['eager_apply_s'] / u['eager_apply_s']:.2f}x")
    print(f"ratio with_policy / hand_written (wall, CPU): first trace "
          f"{ratio('with_policy', 'hand_written', 0):.2f}x, "
          f"{ratio('with_policy', 'hand_written', 1):.2f}x; compile "
          f"{ratio('with_policy', 'hand_written', 2):.2f}x, "
          f"{ratio('with_policy', 'hand_written', 3):.2f}x; equations "
          f"{w['equations'] / h['equations']:.2f}x; HLO instructions "
          f"{w['hlo']['instructions'] / h['hlo']['instructions']:.2f}x")
    return tracing, overhead


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="fmtkit bench policy", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--api", choices=("linen", "nnx"), default="linen")
    p.add_argument("--model", choices=("transformer", "einsum"), default="transformer")
    p.add_argument("--trace-layers", type=int, default=0,
                   help="also time trace/compile of an N-layer step (0: skip)")
    p.add_argument("--trace-preset", default="bf16-mixed",
                   help="the preset of the --trace-layers model (default bf16-mixed)")
    p.add_argument("--trace-rounds", type=int, default=3,
                   help="alternating trace/compile measurements per model (median)")
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--out", default=None, help="output folder (default runs/bench-policy)")
    args = p.parse_args(argv)
    for name in ("d_model", "heads", "layers", "seq", "batch", "repeats", "trace_rounds"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.d_model % args.heads:
        p.error(f"--d-model {args.d_model} must be divisible by --heads {args.heads}")
    if args.model == "einsum" and args.api != "linen":
        p.error("--model einsum is a linen model; use --api linen")

    cfg = models.TransformerConfig(d_model=args.d_model, num_heads=args.heads,
                                   num_layers=args.layers, d_ff=4 * args.d_model,
                                   max_len=args.seq)
    hand_cfg = dataclasses.replace(cfg, dtype="bfloat16", param_dtype="float32",
                                   norm_dtype="float32", router_dtype="float32",
                                   logits_dtype="float32", softmax_f32=args.api == "linen")
    tokens = models.random_tokens(jax.random.key(0), args.batch, args.seq)
    lr = 1e-2
    if args.model == "einsum":
        dims = dict(vocab=256, d_model=args.d_model, heads=args.heads, layers=args.layers)
        plain = EinsumLM(**dims)
        params = jax.jit(plain.init)(jax.random.key(1), tokens)["params"]
        steps = {"hand_written": _linen_step(EinsumLM(**dims, dtype="bfloat16"), lr),
                 "with_policy": _linen_step(with_policy(plain, "bf16-mixed"), lr)}
        args_of = {k: (params, tokens) for k in steps}
    elif args.api == "linen":
        plain = models.TransformerLM(cfg)
        params = jax.jit(plain.init)(jax.random.key(1), tokens)["params"]
        steps = {"hand_written": _linen_step(models.TransformerLM(hand_cfg), lr),
                 "with_policy": _linen_step(with_policy(plain, "bf16-mixed"), lr)}
        args_of = {k: (params, tokens) for k in steps}
    else:
        plain = models.NnxTransformerLM(cfg, rngs=nnx.Rngs(1))
        hand = models.NnxTransformerLM(hand_cfg, rngs=nnx.Rngs(1))
        hand_step, hand_params = _nnx_step(hand, lr)
        pol_step, pol_params = _nnx_step(with_policy(plain, "bf16-mixed"), lr)
        steps = {"hand_written": hand_step, "with_policy": pol_step}
        args_of = {"hand_written": (hand_params, tokens), "with_policy": (pol_params, tokens)}

    compile_s, ops = {}, {}
    for k, fn in steps.items():
        t0 = time.perf_counter()
        compiled = fn.lower(*args_of[k]).compile()
        compile_s[k] = time.perf_counter() - t0
        ops[k] = hlo_op_count(compiled)
    losses = {k: float(steps[k](*args_of[k])[1]) for k in steps}
    times = time_interleaved({k: (lambda k=k: steps[k](*args_of[k])) for k in steps},
                             repeats=args.repeats)
    ratio = times["with_policy"] / times["hand_written"]
    print(f"{args.api} {args.model} d_model={args.d_model} layers={args.layers} "
          f"heads={args.heads} batch={args.batch} seq={args.seq}; median of {args.repeats}")
    for k in steps:
        print(f"  {k:<13} step {times[k] * 1e3:8.2f} ms   HLO ops {ops[k]:6d}   "
              f"compile {compile_s[k]:6.2f} s   loss {losses[k]:.5f}")
    print(f"ratio with_policy / hand_written: {ratio:.3f}x  (target <= 1.05x)")
    tracing, overhead = {}, {}
    if args.trace_layers:
        tracing, overhead = trace_overhead(args, cfg, hand_cfg, tokens, lr)
    file = write_bench_results("policy", {
        "api": args.api, "model": args.model, "config": dataclasses.asdict(cfg),
        "batch": args.batch, "seconds": times, "hlo_ops": ops, "compile_seconds": compile_s,
        "loss": losses, "ratio": ratio, "trace_compile_seconds": tracing,
        "overhead": overhead, "loadavg": os.getloadavg()}, args.out)
    print(f"wrote {file}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
