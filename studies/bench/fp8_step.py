"""Benchmark: one train step under each FP8 recipe vs the same step in bf16 and f32.

    fmtkit bench fp8-step [--batch 512] [--width 512] [--layers 3] [--repeats 15]
                          [--models mlp,transformer] [--recipes current,...]
    fmtkit bench fp8-step --recipes blockwise,mxfp8,nvfp4,mxfp4   # FP4 emulation cost too

Two models, every variant of one model timed in alternation in the same run (median of
``--repeats`` after warm-up, ``block_until_ready`` before reading the clock):

* **mlp**: a GELU MLP of ``--layers`` dense layers of width ``--width`` on ``--batch`` rows,
  written by hand so that each variant differs only in its matmul: ``f32`` (f32 compute),
  ``bf16`` (bf16 compute, f32 parameters), ``fp8-NAME`` (``fmtkit.fp8.dot_general(NAME)`` on
  bf16 inputs; the delayed recipe threads its ``Fp8DotState`` and records observations with
  ``fmtkit.fp8.update_state``), ``flax-fp8`` (Flax's ``Fp8DirectDotGeneralOp``, delayed per
  tensor, its state overwritten by its gradient as Flax prescribes).
* **transformer**: ``studies.models.TransformerLM`` (``--d-model``, ``--layers``,
  ``--seq``, ``--lm-batch``): ``f32`` is the plain model, ``bf16`` is
  ``with_policy(model, "bf16-mixed")``, ``fp8-NAME`` is ``with_policy(model, "fp8-NAME")``
  (the bf16-mixed preset plus the recipe on every linear layer but the head). Flax's op has
  no seam in this model (its layers take no ``dot_general_cls``), so it is MLP-only.

Every step is ``jax.jit`` of loss + gradient + SGD update. Printed: each variant's step time
and its ratios to the bf16 and f32 steps; the ratios to bf16 again, last. (On XLA:CPU every
FP8 dot runs as an f32 GEMM after a fused conversion, while bf16 dots run in bf16: the f32
column separates the quantization overhead from that.)
Saved: runs/bench-fp8-step/results.json. Targets (issue 14, 2-core CPU): per-tensor and
row-wise recipes <= 1.15x the bf16 step, blockwise and MX <= 1.5x.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.linen import fp8_ops

from fmtkit import fp4, fp8
from studies import models
from studies.bench._timing import time_interleaved, write_results

DN = (((1,), (0,)), ((), ()))  # x [B, in] · w [in, out]
TARGETS = {"current": 1.15, "delayed": 1.15, "rowwise": 1.15, "blockwise": 1.5, "mxfp8": 1.5}
"""Issue 14's targets: step time of each recipe over the bf16 step."""


class _Dense(nn.Module):
    """A dense layer whose matmul is the variant under test (``kind``)."""

    features: int
    kind: str  # "f32", "bf16", "flax-fp8" or an fmtkit recipe name

    @nn.compact
    def __call__(self, x):
        w = self.param("kernel", nn.initializers.lecun_normal(), (x.shape[-1], self.features),
                       jnp.float32)
        b = self.param("bias", nn.initializers.zeros, (self.features,), jnp.float32)
        dtype = jnp.float32 if self.kind == "f32" else jnp.bfloat16
        x, w, b = x.astype(dtype), w.astype(dtype), b.astype(dtype)
        if self.kind in ("f32", "bf16"):
            y = lax_dot(x, w)
        elif self.kind == "flax-fp8":
            y = fp8_ops.Fp8DirectDotGeneralOp(name="fp8_op")(x, w, DN)
        else:
            recipe = fp4.get_recipe(self.kind)  # FP8 and FP4 names
            kw = {}
            if recipe.delayed:
                hist = self.variable("fp8_state", "amax_history",
                                     lambda: fp8.init_state(recipe).amax_history)
                kw["fp8_state"] = fp8.Fp8DotState(hist.value)
            y = fp8.dot_general(recipe, name=self.name)(x, w, DN, **kw)
        return y + b[None, :]


def lax_dot(x: jax.Array, w: jax.Array) -> jax.Array:
    return jax.lax.dot_general(x, w, DN, preferred_element_type=x.dtype)


class _Mlp(nn.Module):
    width: int
    layers: int
    kind: str

    @nn.compact
    def __call__(self, x):
        for i in range(self.layers):
            x = _Dense(self.width, self.kind, name=f"Dense_{i}")(x)
            if i < self.layers - 1:
                x = nn.gelu(x)
        return x.astype(jnp.float32)


def _step(apply: Callable[..., Any], loss_of: Callable[[Any, Any], jax.Array], lr: float):
    """jit(step(variables, batch) -> (variables, loss)); differentiates every collection
    but keeps each one's own update rule: SGD on params, ``fp8.update_state`` on
    ``fp8_state``, overwrite on Flax's ``_overwrite_with_gradient``."""

    def step(variables, batch):
        def loss_fn(v):
            return loss_of(apply(v, batch), batch)

        loss, grads = jax.value_and_grad(loss_fn)(variables)
        new = dict(variables)
        new["params"] = jax.tree.map(lambda p, g: p - lr * g, variables["params"],
                                     grads["params"])
        if "fp8_state" in variables:
            new["fp8_state"] = fp8.update_state(variables["fp8_state"], grads["fp8_state"])
        if fp8_ops.OVERWRITE_WITH_GRADIENT in variables:
            new[fp8_ops.OVERWRITE_WITH_GRADIENT] = grads[fp8_ops.OVERWRITE_WITH_GRADIENT]
        return new, loss

    return jax.jit(step)


def _mlp_variants(args, kinds):
    key = jax.random.key(0)
    x = jax.random.normal(key, (args.batch, args.width), jnp.float32)
    target = jax.random.normal(jax.random.key(1), (args.batch, args.width), jnp.float32)
    batch = (x, target)
    out = {}
    for kind in kinds:
        model = _Mlp(args.width, args.layers, kind)
        variables = dict(jax.jit(model.init)(jax.random.key(2), x))
        step = _step(lambda v, b, m=model: m.apply(v, b[0]),
                     lambda y, b: jnp.mean(jnp.square(y - b[1])), args.lr)
        out[kind] = (step, variables, batch)
    return out


def _transformer_variants(args, kinds):
    from fmtkit.policy import with_policy

    cfg = models.TransformerConfig(d_model=args.d_model, num_heads=args.heads,
                                   num_layers=args.layers, d_ff=4 * args.d_model,
                                   max_len=args.seq)
    tokens = models.random_tokens(jax.random.key(0), args.lm_batch, args.seq)
    plain = models.TransformerLM(cfg)
    out = {}
    for kind in kinds:
        if kind == "flax-fp8":
            continue
        model = plain if kind == "f32" else with_policy(
            plain, "bf16-mixed" if kind == "bf16" else
            kind if kind in fp4.RECIPES else f"fp8-{kind}")
        variables = dict(jax.jit(model.init)(jax.random.key(1), tokens))
        step = _step(lambda v, t, m=model: m.apply(v, t),
                     lambda logits, t: models.lm_loss(logits.astype(jnp.float32), t), args.lr)
        out[kind] = (step, variables, tokens)
    return out


def _run(name: str, variants: dict, repeats: int) -> dict[str, Any]:
    compile_s, losses = {}, {}
    for k, (step, variables, batch) in variants.items():
        t0 = time.perf_counter()
        compiled = step.lower(variables, batch).compile()
        compile_s[k] = time.perf_counter() - t0
        losses[k] = float(compiled(variables, batch)[1])
    times = time_interleaved(
        {k: (lambda s=s, v=v, b=b: s(v, b)) for k, (s, v, b) in variants.items()},
        repeats=repeats)
    ratios = {k: t / times["bf16"] for k, t in times.items()}
    to_f32 = {k: t / times["f32"] for k, t in times.items()}
    for k in variants:
        print(f"  {name:<11} {k:<10} step {times[k] * 1e3:8.2f} ms   {ratios[k]:5.2f}x bf16"
              f"   {to_f32[k]:5.2f}x f32   compile {compile_s[k]:5.1f} s   "
              f"loss {losses[k]:.5f}")
    return {"seconds": times, "ratio_to_bf16": ratios, "ratio_to_f32": to_f32,
            "compile_seconds": compile_s, "loss": losses}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="fmtkit bench fp8-step", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="mlp,transformer")
    p.add_argument("--recipes", default=",".join(fp8.RECIPES))
    p.add_argument("--batch", type=int, default=512, help="MLP rows")
    p.add_argument("--width", type=int, default=512, help="MLP width")
    p.add_argument("--layers", type=int, default=3, help="MLP layers and transformer blocks")
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--lm-batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--out", default=None, help="output folder (default runs/bench-fp8-step)")
    args = p.parse_args(argv)
    for name in ("batch", "width", "layers", "d_model", "heads", "seq", "lm_batch", "repeats"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    model_names = [m for m in args.models.split(",") if m]
    for m in model_names:
        if m not in ("mlp", "transformer"):
            p.error(f"--models: unknown model {m!r}; valid: mlp, transformer")
    recipes = [r for r in args.recipes.split(",") if r]
    for r in recipes:
        if r not in fp8.RECIPES and r not in fp4.RECIPES:
            p.error(f"--recipes: unknown recipe {r!r}; valid: "
                    f"{', '.join([*fp8.RECIPES, *fp4.RECIPES])}")
    kinds = ["f32", "bf16", *recipes, "flax-fp8"]

    results: dict[str, Any] = {"args": vars(args), "targets": TARGETS}
    print(f"median of {args.repeats} interleaved steps after warm-up; device "
          f"{jax.devices()[0].device_kind}")
    if "mlp" in model_names:
        print(f"MLP: {args.layers} x Dense({args.width}), batch {args.batch}")
        results["mlp"] = _run("mlp", _mlp_variants(args, kinds), args.repeats)
    if "transformer" in model_names:
        cfg = dict(d_model=args.d_model, layers=args.layers, heads=args.heads, seq=args.seq,
                   batch=args.lm_batch)
        print(f"TransformerLM {cfg}")
        results["transformer"] = _run("transformer", _transformer_variants(args, kinds),
                                      args.repeats)
    print("ratios to the bf16 step (target):")
    for m in model_names:
        row = results[m]["ratio_to_bf16"]
        cells = [f"{k}={row[k]:.2f}x" + (f" (<= {TARGETS[k]})" if k in TARGETS else "")
                 for k in row if k != "bf16"]
        print(f"  {m:<11} " + "  ".join(cells))
    file = write_results("fp8-step", results, args.out)
    print(f"wrote {file}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
