"""Benchmark: one train step under each FP8 recipe vs the same step in bf16 and f32.

    fmtkit bench fp8-step [--batch 512] [--width 512] [--layers 3] [--repeats 15]
                          [--models dense,mlp,transformer] [--recipes current,...]
    fmtkit bench fp8-step --recipes blockwise,mxfp8,nvfp4,mxfp4   # FP4 emulation cost too

Three models, every variant of one model timed in alternation in the same run (median of
``--repeats`` after warm-up, ``block_until_ready`` before reading the clock):

* **dense** (the comparison with Flax's FP8 op, as a user writes it): ``--layers`` ``nn.Dense`` of
  width ``--dense-width`` (1024) on ``--dense-batch`` (256) rows, relu, MSE, ``optax.adamw``,
  f32 parameters and compute, state donated: ``f32`` (plain ``nn.Dense``), ``fp8-NAME``
  (``nn.Dense(dot_general=fmtkit.fp8.dot_general_fn(NAME))``; the delayed recipe's history
  in an ``fp8_state`` variable, recorded with ``fmtkit.fp8.update_state``) and ``flax-fp8``
  (``nn.Dense(dot_general_cls=nn.Fp8DirectDotGeneralOp)``). No bf16 variant (f32 compute).

* **mlp**: a GELU MLP of ``--layers`` dense layers of width ``--width`` on ``--batch`` rows,
  written by hand so that each variant differs only in its matmul: ``f32`` (f32 compute),
  ``bf16`` (bf16 compute, f32 parameters), ``fp8-NAME`` (``fmtkit.fp8.dot_general_fn(NAME)`` on
  bf16 inputs; the delayed recipe threads its ``DelayedScalingState`` and records observations
  with ``fmtkit.fp8.update_state``), ``flax-fp8`` (Flax's ``Fp8DirectDotGeneralOp``, delayed per
  tensor, its state overwritten by its gradient as Flax prescribes).
* **transformer**: ``studies.lib.models.TransformerLM`` (``--d-model``, ``--layers``,
  ``--seq``, ``--lm-batch``): ``f32`` is the plain model, ``bf16`` is
  ``with_policy(model, "bf16-mixed")``, ``fp8-NAME`` is ``with_policy(model, "fp8-NAME")``
  (the bf16-mixed preset plus the recipe on every linear layer but the head). Flax's op has
  no seam in this model (its layers take no ``dot_general_cls``), so it is MLP-only.
* **llama**: a Llama-style stack at a width where FP8's GEMM speed shows: ``--llama-layers``
  (4) pre-norm blocks of d_model ``--llama-d-model`` (4096), ``--llama-heads`` (32) heads,
  a SwiGLU MLP of ``--llama-ff`` (11008), RMSNorm, no biases, ``--llama-tokens`` (8192)
  tokens a step in sequences of ``--llama-seq`` (2048); the same variants as the
  transformer (``with_policy`` presets). Its GEMMs are 8192 x 4096 x 4096 and
  8192 x 11008 x 4096: on a CPU that is minutes a step, so off GPUs it runs at a rehearsal
  size (d_model 64, MLP 172, 128 tokens) and says so, unless ``--llama-full``.

Example, the realistic configuration beside the d_model-1024 one (on a GPU)::

    fmtkit bench fp8-step --models transformer,llama --recipes current,delayed,blockwise \
        --d-model 1024 --layers 4 --heads 8 --seq 1024 --lm-batch 8

Every mlp / transformer step is ``jax.jit`` of loss + gradient + SGD update. Printed: each
variant's step time and its ratios to the bf16, f32 and Flax-op steps (where the model has
them); the ratios to Flax's op and to bf16 again, last. (On XLA:CPU every
FP8 dot runs as an f32 GEMM after a fused conversion, while bf16 dots run in bf16: the f32
column separates the quantization overhead from that.)
Saved: runs/bench-fp8-step/results.json. Targets: on a 2-core CPU, per-tensor and
row-wise recipes <= 1.15x the bf16 step, blockwise and MX <= 1.5x; against Flax's
op in the same model: per tensor <= 1.05x, blockwise and MX <= 1.3x.
"""

from __future__ import annotations

import argparse
import functools
import os
import time
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax.linen import fp8_ops

import pallas_kernels  # noqa: F401  registers the Pallas GEMM backend for "auto" from a checkout too
from fmtkit import DelayedScalingState, fp4, fp8
from studies.lib import models
from studies.lib.common import write_bench_results
from studies.lib.timing import time_interleaved

# How the command line lists this benchmark (studies.app.registry).
NAME = "fp8-step"
SUMMARY = "one train step under each FP8 recipe vs the same step in bf16 and f32"

DN = (((1,), (0,)), ((), ()))  # x [B, in] · w [in, out]
TARGETS = {"current": 1.15, "delayed": 1.15, "rowwise": 1.15, "blockwise": 1.5, "mxfp8": 1.5}
"""The targets on a 2-core CPU: step time of each recipe over the bf16 step."""
FLAX_TARGETS = {"current": 1.05, "delayed": 1.05, "rowwise": 1.05, "blockwise": 1.3,
                "mxfp8": 1.3}
"""The targets against Flax: step time of each recipe over Flax's ``Fp8DirectDotGeneralOp`` step."""


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
                kw["fp8_state"] = DelayedScalingState(hist.value)
            y = fp8.dot_general_fn(recipe, name=self.name)(x, w, DN, **kw)
        return y + b[None, :]


def lax_dot(x: jax.Array, w: jax.Array) -> jax.Array:
    return jax.lax.dot_general(x, w, DN, preferred_element_type=x.dtype)


class _Mlp(nn.Module):
    """``layers`` dense layers of ``width`` with ``activation`` between them: the bench's
    hand-written layers (``_Dense``, GELU) or ``nn.Dense`` as a user plugs FP8 into it
    (``user_dense``: ``_UserDense``, ReLU, as in the dense model)."""

    width: int
    layers: int
    kind: str
    activation: Callable[[jax.Array], jax.Array] = nn.gelu
    user_dense: bool = False

    @nn.compact
    def __call__(self, x):
        layer = _UserDense if self.user_dense else _Dense
        for i in range(self.layers):
            x = layer(self.width, self.kind, name=f"Dense_{i}")(x)
            if i < self.layers - 1:
                x = self.activation(x)
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


class _UserDense(nn.Module):
    """``nn.Dense`` as a user plugs FP8 into it (``kind``: "f32", "flax-fp8" or a recipe)."""

    features: int
    kind: str

    @nn.compact
    def __call__(self, x):
        if self.kind == "f32":
            return nn.Dense(self.features, name="Dense")(x)
        if self.kind == "flax-fp8":
            return nn.Dense(self.features, dot_general_cls=fp8_ops.Fp8DirectDotGeneralOp,
                            name="Dense")(x)
        recipe = fp4.get_recipe(self.kind)
        dg = fp8.dot_general_fn(recipe)
        if recipe.delayed:
            hist = self.variable("fp8_state", "amax_history",
                                 lambda: fp8.init_state(recipe).amax_history)
            dg = functools.partial(dg, fp8_state=DelayedScalingState(hist.value))
        return nn.Dense(self.features, dot_general=dg, name="Dense")(x)


def _adamw_step(model: nn.Module, lr: float):
    """jit(step(state, batch) -> (state, loss)), state = (variables, adamw state), donated:
    MSE loss, ``optax.adamw`` on params, ``fp8.update_state`` on ``fp8_state``, overwrite on
    Flax's ``_overwrite_with_gradient``."""
    tx = optax.adamw(lr)

    def step(state, batch):
        variables, opt = state
        x, target = batch

        def loss_fn(v):
            return jnp.mean(jnp.square(model.apply(v, x) - target))

        loss, grads = jax.value_and_grad(loss_fn)(variables)
        with jax.numpy_dtype_promotion("standard"):  # optax's bias correction mixes types
            updates, opt = tx.update(grads["params"], opt, variables["params"])
        new = dict(variables)
        new["params"] = optax.apply_updates(variables["params"], updates)
        if "fp8_state" in variables:
            new["fp8_state"] = fp8.update_state(variables["fp8_state"], grads["fp8_state"])
        if fp8_ops.OVERWRITE_WITH_GRADIENT in variables:
            new[fp8_ops.OVERWRITE_WITH_GRADIENT] = grads[fp8_ops.OVERWRITE_WITH_GRADIENT]
        return (new, opt), loss

    return jax.jit(step, donate_argnums=0), tx


def _dense_variants(args, kinds):
    x = jax.random.normal(jax.random.key(0), (args.dense_batch, args.dense_width), jnp.float32)
    target = jax.random.normal(jax.random.key(1), x.shape, jnp.float32)
    out = {}
    for kind in kinds:
        if kind == "bf16":
            continue
        model = _Mlp(args.dense_width, args.layers, kind, nn.relu, user_dense=True)
        variables = dict(jax.jit(model.init)(jax.random.key(2), x))
        step, tx = _adamw_step(model, args.adam_lr)
        out[kind] = (step, (variables, tx.init(variables["params"])), (x, target))
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


LLAMA = {"d_model": 4096, "ff": 11008, "layers": 4, "heads": 32, "tokens": 8192, "seq": 2048}
"""The realistic configuration: the block widths of Llama 2 7B (hidden size 4096, SwiGLU
intermediate size 11008, 32 heads: its published config; Touvron et al. 2023,
arXiv:2307.09288), 4 blocks, 8192 tokens a step."""
LLAMA_REHEARSAL = {"d_model": 64, "ff": 172, "layers": 4, "heads": 4, "tokens": 128,
                   "seq": 64}
"""The same model off GPUs: widths scaled by 1/64, 128 tokens."""


class _LlamaBlock(nn.Module):
    """A pre-norm Llama-style block: RMSNorm, causal self-attention without biases, RMSNorm,
    SwiGLU MLP (``down(silu(gate(h)) * up(h))``)."""

    d_model: int
    d_ff: int
    heads: int

    @nn.compact
    def __call__(self, x):
        h = nn.RMSNorm(name="attn_norm")(x)
        qkv = nn.DenseGeneral((3, self.heads, self.d_model // self.heads), use_bias=False,
                              name="qkv")(h)
        mask = nn.make_causal_mask(jnp.ones(x.shape[:2], bool))
        a = nn.dot_product_attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], mask=mask)
        x = x + nn.DenseGeneral(self.d_model, axis=(-2, -1), use_bias=False, name="o")(a)
        h = nn.RMSNorm(name="mlp_norm")(x)
        gate = nn.Dense(self.d_ff, use_bias=False, name="gate")(h)
        up = nn.Dense(self.d_ff, use_bias=False, name="up")(h)
        return x + nn.Dense(self.d_model, use_bias=False, name="down")(nn.silu(gate) * up)


class _Llama(nn.Module):
    """Byte embeddings, ``layers`` ``_LlamaBlock`` s, RMSNorm and the output head."""

    d_model: int
    d_ff: int
    heads: int
    layers: int
    vocab: int = 256

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(self.vocab, self.d_model, name="embed")(tokens)
        for i in range(self.layers):
            x = _LlamaBlock(self.d_model, self.d_ff, self.heads, name=f"block_{i}")(x)
        return nn.Dense(self.vocab, use_bias=False, name="head")(nn.RMSNorm(name="ln_f")(x))


def llama_size(full: bool) -> tuple[dict, bool]:
    """The llama model's sizes and whether they are the realistic ones: ``LLAMA`` on a GPU
    or when asked (``full``), else ``LLAMA_REHEARSAL``."""
    real = full or jax.default_backend() == "gpu"
    return (LLAMA if real else LLAMA_REHEARSAL), real


def _llama_variants(size: dict, kinds, lr: float):
    from fmtkit.policy import with_policy

    tokens = models.random_tokens(jax.random.key(0), size["tokens"] // size["seq"],
                                  size["seq"])
    plain = _Llama(size["d_model"], size["ff"], size["heads"], size["layers"])
    out = {}
    for kind in kinds:
        if kind == "flax-fp8":
            continue
        model = plain if kind == "f32" else with_policy(
            plain, "bf16-mixed" if kind == "bf16" else
            kind if kind in fp4.RECIPES else f"fp8-{kind}")
        variables = dict(jax.jit(model.init)(jax.random.key(1), tokens))
        step = _step(lambda v, t, m=model: m.apply(v, t),
                     lambda logits, t: models.lm_loss(logits.astype(jnp.float32), t), lr)
        out[kind] = (step, variables, tokens)
    return out


def _run(name: str, variants: dict, repeats: int) -> dict[str, Any]:
    compile_s, losses, steps, kernel_calls = {}, {}, {}, {}
    for k, (step, state, batch) in variants.items():
        t0 = time.perf_counter()
        compiled = step.lower(state, batch).compile()
        compile_s[k] = time.perf_counter() - t0
        # Pallas kernels lowered for a GPU are Mosaic GPU custom calls in the compiled step.
        kernel_calls[k] = compiled.as_text().count('custom_call_target="mosaic_gpu')
        # (dense steps donate their state: the probe call gets a copy)
        losses[k] = float(compiled(jax.tree.map(jnp.copy, state), batch)[1])
        steps[k] = [step, state, batch]

    def call(k):
        step, state, batch = steps[k]
        new, loss = step(state, batch)
        if name == "dense":
            steps[k][1] = new
        return loss

    times = time_interleaved({k: functools.partial(call, k) for k in variants},
                             repeats=repeats)
    cols = {f"ratio_to_{b.replace('-fp8', '')}": {k: t / times[b] for k, t in times.items()}
            for b in ("bf16", "f32", "flax-fp8") if b in times}
    for k in variants:
        cells = "".join(f"   {row[k]:5.2f}x {c.removeprefix('ratio_to_')}"
                        for c, row in cols.items())
        print(f"  {name:<11} {k:<10} step {times[k] * 1e3:8.2f} ms{cells}   "
              f"compile {compile_s[k]:5.1f} s   loss {losses[k]:.5f}   "
              f"Pallas kernel calls {kernel_calls[k]}")
    return {"seconds": times, **cols, "compile_seconds": compile_s, "loss": losses,
            "pallas_kernel_calls": kernel_calls}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="fmtkit bench fp8-step", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="dense,mlp,transformer")
    p.add_argument("--recipes", default=",".join(fp8.RECIPES))
    p.add_argument("--batch", type=int, default=512, help="MLP rows")
    p.add_argument("--width", type=int, default=512, help="MLP width")
    p.add_argument("--layers", type=int, default=3, help="MLP layers and transformer blocks")
    p.add_argument("--dense-batch", type=int, default=256, help="dense model rows")
    p.add_argument("--dense-width", type=int, default=1024, help="dense model width")
    p.add_argument("--adam-lr", type=float, default=1e-3, help="dense model's adamw")
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--lm-batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--baselines", default="f32,bf16",
                   help="the non-FP8 variants timed beside the recipes (f32, bf16 or both)")
    p.add_argument("--llama-full", action="store_true",
                   help="the llama model at its realistic size off GPUs too (minutes a step)")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--out", default=None, help="output folder (default runs/bench-fp8-step)")
    args = p.parse_args(argv)
    for name in ("batch", "width", "dense_batch", "dense_width", "layers", "d_model", "heads",
                 "seq", "lm_batch", "repeats"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    model_names = [m for m in args.models.split(",") if m]
    for m in model_names:
        if m not in ("dense", "mlp", "transformer", "llama"):
            p.error(f"--models: unknown model {m!r}; valid: dense, mlp, transformer, llama")
    recipes = [r for r in args.recipes.split(",") if r]
    for r in recipes:
        if r not in fp8.RECIPES and r not in fp4.RECIPES:
            p.error(f"--recipes: unknown recipe {r!r}; valid: "
                    f"{', '.join([*fp8.RECIPES, *fp4.RECIPES])}")
    baselines = [b for b in args.baselines.split(",") if b]
    for b in baselines:
        if b not in ("f32", "bf16"):
            p.error(f"--baselines: unknown variant {b!r}; valid: f32, bf16")
    kinds = [*baselines, *recipes, "flax-fp8"]

    results: dict[str, Any] = {"args": vars(args), "targets": TARGETS,
                               "flax_targets": FLAX_TARGETS}
    load = [round(v, 2) for v in os.getloadavg()]
    print(f"median of {args.repeats} interleaved steps after warm-up; device "
          f"{jax.devices()[0].device_kind}; load average {load[0]} (1 min) at start")
    if "dense" in model_names:
        print(f"dense: {args.layers} x nn.Dense({args.dense_width}), batch {args.dense_batch}, "
              "relu, MSE, adamw, f32")
        results["dense"] = _run("dense", _dense_variants(args, kinds), args.repeats)
    if "mlp" in model_names:
        print(f"MLP: {args.layers} x Dense({args.width}), batch {args.batch}")
        results["mlp"] = _run("mlp", _mlp_variants(args, kinds), args.repeats)
    if "transformer" in model_names:
        cfg = dict(d_model=args.d_model, layers=args.layers, heads=args.heads, seq=args.seq,
                   batch=args.lm_batch)
        print(f"TransformerLM {cfg}")
        results["transformer"] = _run("transformer", _transformer_variants(args, kinds),
                                      args.repeats)
    if "llama" in model_names:
        size, real = llama_size(args.llama_full)
        print(f"Llama-style {size}" + ("" if real else (
            f" (a rehearsal size: the realistic one, {LLAMA}, runs on a GPU or with "
            "--llama-full)")))
        results["llama"] = _run("llama", _llama_variants(size, kinds, args.lr),
                                args.repeats)
        results["llama"]["size"], results["llama"]["realistic"] = size, real
    print("ratios to Flax's Fp8DirectDotGeneralOp in the same model (target):")
    for m in model_names:
        row = results[m].get("ratio_to_flax")
        if row is None:
            print(f"  {m:<11} (Flax's op has no seam in this model)")
            continue
        cells = [f"{k}={row[k]:.2f}x" + (f" (<= {FLAX_TARGETS[k]})" if k in FLAX_TARGETS
                                         else "") for k in row if k != "flax-fp8"]
        print(f"  {m:<11} " + "  ".join(cells))
    print("ratios to the bf16 step (target):")
    for m in model_names:
        if "ratio_to_bf16" not in results[m]:
            continue
        row = results[m]["ratio_to_bf16"]
        cells = [f"{k}={row[k]:.2f}x" + (f" (<= {TARGETS[k]})" if k in TARGETS else "")
                 for k in row if k != "bf16"]
        print(f"  {m:<11} " + "  ".join(cells))
    results["load_average"] = {"start": load, "end": [round(v, 2) for v in os.getloadavg()]}
    print(f"load average {results['load_average']['end'][0]} (1 min) at the end: other "
          "processes share the CPU; only the ratios within one run mean anything")
    file = write_bench_results("fp8-step", results, args.out)
    print(f"wrote {file}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
