"""The fp4-training regime of ``fmtkit ablate``: NVFP4's ingredients and MXFP4 at laptop scale.

``fmtkit ablate --regime fp4-training`` trains ``GROUP`` (bf16-mixed first, the reference)
on a 4-block tiny model (``studies.lib.regimes.FP4Training``), several seeds each, and reports
the paired gaps as for every regime. This module adds the regime's telemetry, measured on
seed 0 with the batch after the last step, at the initial parameters and at each setup's
trained parameters:

* per GEMM operand of every linear layer that runs in FP4 (its input x and its weight w, as
  the forward GEMM quantizes them, and the loss gradient at its output, dy, as the dgrad GEMM
  does; x and dy from the plain f32 model): ``fmtkit.fp4.quantization_stats`` (SQNR, share
  of blocks whose scaled elements saturate at ±6 or that underflow to zeros);
* ``grad_noise_ratio``: the norm of the BF16 weight gradient of the FP4 layers over the norm
  of the FP4 gradient's difference from it (``studies.lib.regimes.grad_noise_ratio``; below
  about sqrt(3), "FP4 All the Way" finds FP4 training stops helping), as a curve over
  training: at ``noise_steps(steps)`` (``NOISE_POINTS`` evenly spaced step counts, 0 and the
  last included), on seed 0's parameters of that setup kept after that many steps
  (``train_seeds(snapshot_steps=...)``: a host copy, the training is unchanged), always with
  the same batch (the one after the last step), so that the curve moves with the parameters
  only. The FP4 gradient is the training step's own (``train_seeds(grad_batch=...)`` runs
  the compiled step on that batch at those steps and drops its new state), so the regime
  compiles each setup's FP4 gradient once, in its step; the BF16 reference gradient is one
  compile for the group (``reference_grad``).

The quantization stats are jitted per operand shape and per recipe reduced to what
quantizes that operand, so setups that quantize it alike share the compile.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from fmtkit import fp4
from fmtkit.policy import find_stack
from studies.lib import regimes
from studies.lib.models import TransformerLM, lm_loss
from studies.training.config import TrainConfig
from studies.training.setups import get_setup
from studies.training.step import build_model, setup_rules

__all__ = ["GROUP", "NOISE_POINTS", "REFERENCE", "noise_steps", "plot_noise", "reference_grad",
           "setup_telemetry", "summary_lines"]

GROUP = ("bf16-mixed", "fp8-blockwise", "nvfp4", "nvfp4-no-rht", "nvfp4-no-sr", "nvfp4-no-2d",
         "nvfp4-all-layers", "mxfp4")
"""The setups of the regime, reference first."""

REFERENCE = "bf16-mixed"

NOISE_POINTS = 5
"""Points of the gradient-noise curve: enough to see a trend over training, few enough that
its cost (two gradients per point and FP4 setup, one batch) stays a few seconds."""


def noise_steps(steps: int, points: int = NOISE_POINTS) -> tuple[int, ...]:
    """The step counts at which the gradient-noise ratio is measured: ``points`` evenly
    spaced over ``0..steps`` (both ends included, duplicates dropped)."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be an int >= 1, got {steps!r}.")
    if isinstance(points, bool) or not isinstance(points, int) or points < 2:
        raise ValueError(f"points must be an int >= 2, got {points!r}.")
    return tuple(sorted({round(i * steps / (points - 1)) for i in range(points)}))


def _linear_inputs(cfg: TrainConfig, params: Any, tokens: jax.Array) -> dict[str, jax.Array]:
    """Module path -> the input of every Dense / DenseGeneral call of the plain model, as
    ``[tokens, contraction]``."""
    found: dict[str, jax.Array] = {}

    def grab(next_fun, args, kwargs, context):
        if context.method_name == "__call__" and isinstance(
                context.module, nn.Dense | nn.DenseGeneral) and args:
            found["/".join(context.module.path)] = args[0]
        return next_fun(*args, **kwargs)

    with nn.intercept_methods(grab):
        TransformerLM(cfg.model_config()).apply({"params": params}, tokens)
    return {k: v.reshape(tokens.size, -1) for k, v in found.items()}


def _output_grads(cfg: TrainConfig, params: Any, tokens: jax.Array) -> dict[str, jax.Array]:
    """Module path -> the loss gradient at the output of every Dense / DenseGeneral of the
    plain model (what its dgrad and wgrad GEMMs read), as ``[tokens, features]``: Flax's
    ``perturb`` on each output, differentiated."""
    grads = _output_grads_fn(cfg.model_config())(params, tokens)
    out = {}
    for path, g in jax.tree_util.tree_leaves_with_path(grads):
        names = [getattr(k, "key", str(k)) for k in path][:-1]  # drop the "dy" leaf name
        out["/".join(names)] = g.reshape(tokens.size, -1)
    return out


@functools.lru_cache(maxsize=4)
def _output_grads_fn(model_config: Any) -> Any:
    """The jitted ``(params, tokens) -> perturbation gradients`` of the plain model: one
    compile per model, shared by every setup of the group (the plain model is the same)."""
    def hook(next_fun, args, kwargs, context):
        y = next_fun(*args, **kwargs)
        if context.method_name == "__call__" and isinstance(
                context.module, nn.Dense | nn.DenseGeneral):
            y = context.module.perturb("dy", y)
        return y

    model = TransformerLM(model_config)

    def grads(params, tokens):
        with nn.intercept_methods(hook):
            zeros = jax.eval_shape(model.init, jax.random.key(0), tokens)["perturbations"]
        zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), zeros)

        def loss(pert):
            with nn.intercept_methods(hook):
                logits = model.apply({"params": params, "perturbations": pert}, tokens)
            return lm_loss(logits.astype(jnp.float32), tokens)

        return jax.grad(loss)(zeros)

    return jax.jit(grads)


def _fp4_layers(name: str, cfg: TrainConfig, paths: list[str]) -> dict[str, fp4.Fp4Recipe]:
    """Module path -> FP4 recipe, for the setup's linear layers that run in FP4."""
    rules = setup_rules(get_setup(name), cfg)
    prefix, _ = find_stack(paths)  # the blocks' layers (the head is found by role, not path)
    out = {}
    for path in paths:
        if not path.startswith(prefix):
            continue
        pol = rules.resolve(path, ())
        if pol is not None and isinstance(pol.fp8, fp4.Fp4Recipe):
            out[path] = pol.fp8
    return out


def _kernel(params: Any, path: str) -> jax.Array:
    node = params
    for part in path.split("/"):
        node = node[part]
    k = node["kernel"]
    # Flax kernels are [in..., out...]; the GEMM's w is [out, in] (contraction minor).
    n_in = k.ndim - 1 if k.ndim == 2 else (1 if path.endswith(("query", "key", "value"))
                                            else 2)
    k2 = k.reshape(int(np.prod(k.shape[:n_in])), -1)
    return k2.T


def _grad_fn(model: Any) -> Any:
    """The jitted parameter gradient of the LM loss (the reference's; an FP4 setup's comes
    from its training step's compile, ``train_seeds(grad_batch=...)``)."""
    return jax.jit(jax.grad(lambda p, tokens: lm_loss(
        model.apply({"params": p}, tokens).astype(jnp.float32), tokens)))


_jit_stats = jax.jit(fp4.quantization_stats, static_argnums=(1, 2))


def _operand_recipe(recipe: fp4.Fp4Recipe, operand: str) -> fp4.Fp4Recipe:
    """``recipe`` with only what quantizes ``operand`` kept (its tile and rounding, in all
    three slots; the RHT, which acts on the wgrad GEMM only, off; a fixed name): recipes
    that quantize the operand alike then share one compile of its stats (nvfp4, no-RHT and
    every-layer for all three operands, no-SR for x and w, no-2D for x and grad)."""
    tile, rounding = getattr(recipe, f"{operand}_tile"), getattr(recipe, f"{operand}_rounding")
    return dataclasses.replace(recipe, name="stats", rht=False, rht_seed=0, x_tile=tile,
                               w_tile=tile, grad_tile=tile, x_rounding=rounding,
                               w_rounding=rounding, grad_rounding=rounding)


def _stats(t: jax.Array, recipe: fp4.Fp4Recipe, operand: str) -> dict[str, float]:
    """``fp4.quantization_stats`` of one operand as floats (jitted, one compile per operand
    shape and ``_operand_recipe``)."""
    return {k: float(v) for k, v in
            _jit_stats(t, _operand_recipe(recipe, operand), operand).items()}


def _select(tree: Any, paths: list[str]) -> dict[str, Any]:
    """``{path: {"kernel": kernel}}`` of the given modules (weight matrices only)."""
    out = {}
    for path in paths:
        node = tree
        for part in path.split("/"):
            node = node[part]
        out[path] = {"kernel": node["kernel"]}
    return out


def _noise_ratio(ref_grad: Any, grad: Any, params: Any, tokens: jax.Array,
                 paths: list[str]) -> float:
    """``regimes.grad_noise_ratio`` of the layers ``paths``: the FP4 gradient ``grad`` at
    ``params`` against the reference's (``ref_grad`` at ``params`` cast to f32)."""
    params = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), params)
    return float(regimes.grad_noise_ratio(_select(ref_grad(params, tokens), paths),
                                          _select(grad, paths)))


def reference_grad(cfg: TrainConfig, params: Any, tokens: jax.Array) -> Any:
    """The reference setup's parameter gradient of the LM loss, compiled for f32 ``params``
    like the given ones and ``tokens``: what ``setup_telemetry`` compares each FP4 setup's
    gradient with (compile it once per group)."""
    f32 = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), params)
    return _grad_fn(build_model(get_setup(REFERENCE), cfg)).lower(f32, tokens).compile()


def setup_telemetry(cfg: TrainConfig, name: str, snapshots: dict[int, Any],
                    grads: dict[int, Any], tokens: jax.Array,
                    ref_grad: Callable[[], Any] | None = None) -> dict[str, Any] | None:
    """The regime's telemetry (module docstring) of one setup; None when none of its layers
    runs in FP4.

    Args:
      cfg: the group's training configuration (regime applied).
      name: the setup.
      snapshots: {step: seed 0's parameters after that many steps} (``SeedsResult
        .snapshots``), the trained ones last: the quantization stats are taken there.
      grads: {step: the setup's parameter gradient on ``tokens`` at ``snapshots[step]``}
        (``SeedsResult.snapshot_grads``: from the training step's own compile).
      tokens: the batch of ``grads``, ``[batch, seq_len]``.
      ref_grad: returns ``reference_grad``'s function (shared by the group's setups; None:
        built here).

    Returns:
      ``{"layers": {path: {"x": stats, "w": stats, "grad": stats}} (at the trained
      parameters), "grad_noise_ratio": {"initial": r0, "trained": r1},
      "grad_noise_curve": {"steps": [t...], "ratio": [r...]}}`` with floats (the curve in
      step order, one point per snapshot).

    Independent of the other setups, so ``fmtkit ablate`` runs it in the setup's own
    thread, right after its training.
    """
    if sorted(snapshots) != sorted(grads) or not snapshots:
        raise ValueError(f"snapshots and grads must hold the same steps (at least one), got "
                         f"{sorted(snapshots)} and {sorted(grads)}.")
    steps = sorted(snapshots)
    params = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), snapshots[steps[-1]])
    inputs = _linear_inputs(cfg, params, tokens)
    layers = _fp4_layers(name, cfg, list(inputs))
    if not layers:
        return None
    out_grads = _output_grads(cfg, params, tokens)
    stats = {}
    for path, recipe in layers.items():
        stats[path] = {"x": _stats(inputs[path], recipe, "x"),
                       "w": _stats(_kernel(params, path), recipe, "w"),
                       "grad": _stats(out_grads[path], recipe, "grad")}
    ref = reference_grad(cfg, params, tokens) if ref_grad is None else ref_grad()
    curve = [_noise_ratio(ref, grads[t], snapshots[t], tokens, list(layers)) for t in steps]
    return {"layers": stats,
            "grad_noise_ratio": {"initial": curve[0], "trained": curve[-1]},
            "grad_noise_curve": {"steps": steps, "ratio": curve}}


def summary_lines(info: dict[str, Any]) -> list[str]:
    """Lines under the regime's table: per setup, the median over its FP4 layers of each
    operand's SQNR and block shares, and the gradient-noise ratio."""
    lines = []
    for name, d in info.items():
        parts = []
        for op in ("x", "w", "grad"):
            vals = [s[op] for s in d["layers"].values()]
            parts.append(
                f"{op} SQNR {np.median([v['sqnr_db'] for v in vals]):.1f} dB, saturated "
                f"{100 * np.median([v['saturation_block_share'] for v in vals]):.1f}% "
                f"/ underflow "
                f"{100 * np.median([v['underflow_block_share'] for v in vals]):.2f}% of blocks")
        c = d.get("grad_noise_curve") or {
            "steps": ["init", "end"], "ratio": [d["grad_noise_ratio"]["initial"],
                                                d["grad_noise_ratio"]["trained"]]}
        curve = ", ".join(f"{r:.2f}" for r in c["ratio"])
        took = f", telemetry {d['seconds']:.0f} s" if "seconds" in d else ""
        lines.append(f"  {name}: {'; '.join(parts)}; |g| / |FP4 noise| at steps "
                     f"{'/'.join(map(str, c['steps']))}: {curve} "
                     f"({len(d['layers'])} FP4 layers{took})")
    return lines


def plot_noise(info: dict[str, Any], out_dir: Any, name: str) -> Any:
    """``out_dir/name.png``: each FP4 setup's gradient-noise ratio over training (seed 0),
    log scale, with the sqrt(3) line below which FP4 training stops helping
    [FP4AllTheWay]. Returns the path, or None when no setup has a curve."""
    from studies.lib.common import figure, plot_style, save

    curves = {k: d["grad_noise_curve"] for k, d in info.items() if d.get("grad_noise_curve")}
    if not curves:
        return None
    with plot_style():
        fig, ax = figure(width=7.0, height=4.4)
        for label, c in curves.items():
            ax.plot(c["steps"], c["ratio"], marker="o", label=label)
        ax.axhline(float(np.sqrt(3.0)), color="k", lw=0.8, ls=":", label="sqrt(3)")
        ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.set_ylabel("|g_bf16| / |g_fp4 - g_bf16|")
        ax.set_title("FP4 layers' weight gradient over its FP4 noise (seed 0, one batch)")
        ax.legend(fontsize=7)
        return save(fig, out_dir, name)
