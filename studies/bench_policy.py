"""Benchmark: a train step under ``with_policy(model, "bf16-mixed")`` vs the same model
written by hand in mixed precision.

    fmtkit bench policy [--api linen|nnx] [--d-model 128] [--layers 2] [--seq 64] [--batch 8]

The model is ``studies.models.TransformerLM`` (or ``NnxTransformerLM``). The baseline is the
same class configured by hand the way a user writes mixed precision with Flax's own knobs:
``dtype=bfloat16, param_dtype=float32``, norms and router with ``dtype=float32``, logits cast
to f32 (linen: attention softmax in f32 too, as the policy does). The policied model is the
unmodified f32 model wrapped by ``with_policy``. Both steps are ``jax.jit`` of loss + grad +
SGD update on the same parameters and tokens, timed in alternation after warm-up (median).
Printed: both step times, both compiled-HLO instruction counts, compile times, then the ratio
(target, issue 3: at most 1.05x).
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import time

import jax
from flax import nnx

from fmtkit.policy import with_policy
from studies import models
from studies._bench import time_interleaved, write_results

_INSTR = re.compile(r"^\s*(ROOT\s+)?%?[\w.\-]+ = ", re.MULTILINE)


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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="fmtkit bench policy", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--api", choices=("linen", "nnx"), default="linen")
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--out", default=None, help="output folder (default runs/bench-policy)")
    args = p.parse_args(argv)
    for name in ("d_model", "heads", "layers", "seq", "batch", "repeats"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.d_model % args.heads:
        p.error(f"--d-model {args.d_model} must be divisible by --heads {args.heads}")

    cfg = models.TransformerConfig(d_model=args.d_model, num_heads=args.heads,
                                   num_layers=args.layers, d_ff=4 * args.d_model,
                                   max_len=args.seq)
    hand_cfg = dataclasses.replace(cfg, dtype="bfloat16", param_dtype="float32",
                                   norm_dtype="float32", router_dtype="float32",
                                   logits_dtype="float32", softmax_f32=args.api == "linen")
    tokens = models.random_tokens(jax.random.key(0), args.batch, args.seq)
    lr = 1e-2
    if args.api == "linen":
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
    print(f"{args.api} TransformerLM d_model={args.d_model} layers={args.layers} "
          f"heads={args.heads} batch={args.batch} seq={args.seq}; median of {args.repeats}")
    for k in steps:
        print(f"  {k:<13} step {times[k] * 1e3:8.2f} ms   HLO ops {ops[k]:6d}   "
              f"compile {compile_s[k]:6.2f} s   loss {losses[k]:.5f}")
    print(f"ratio with_policy / hand_written: {ratio:.3f}x  (target <= 1.05x)")
    file = write_results("policy", {
        "api": args.api, "config": dataclasses.asdict(cfg), "batch": args.batch,
        "seconds": times, "hlo_ops": ops, "compile_seconds": compile_s, "loss": losses,
        "ratio": ratio}, args.out)
    print(f"wrote {file}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
