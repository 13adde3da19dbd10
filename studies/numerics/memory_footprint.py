"""Study ``memory``: bytes per parameter of training state, and activation memory per layer
without and with rematerialization.

**Model state** (``fmtkit.memory.ledger``): for each row, a precision policy applied to the
small transformer (``fmtkit.with_policy``; its ``init`` traced with ``jax.eval_shape``, so the
parameter dtypes are the policy's own) and an optimizer, whose state is
``jax.eval_shape(optimizer.init, params)``: nothing is allocated, every byte is counted from
the real pytrees. The gradient tree is ``jax.eval_shape(jax.grad(loss), params)``: its dtypes
are what JAX produces (the cotangent of an f32 parameter is f32 even when the compute is
bf16). Expected, by hand (per parameter; ZeRO, Rajbhandari et al. 2020, section 3.1):

    fp32 + AdamW                                4 + 4 + 0 + 4 + 4 = 16
    bf16-mixed (f32 params) + AdamW             4 + 4 + 0 + 4 + 4 = 16  (saves activations)
    fp8-delayed (f32 params) + AdamW            4 + 4 + 0 + 4 + 4 = 16  + fixed amax histories
    pure-bf16 + AdamW (bf16 moments)            2 + 2 + 0 + 2 + 2 = 8
    pure-bf16 + f32 master + AdamW              2 + 2 + 4 + 4 + 4 = 16  (ZeRO's 16 bytes)
    pure-bf16 + f32 master + AdamW bf16 moments 2 + 2 + 4 + 2 + 2 = 12  (DeepSeek-V3, sec. 3.3)
    pure-bf16 + f32 master + AdamW m E4M3, v fp16 (MS-AMP O2)  2 + 2 + 4 + 1 + 2 = 11 + scales
    pure-bf16 + Kahan-compensated AdamW         2 + 2 + 0 + 2 + 2 + 2 (compensation) = 10
    pure-bf16 + stochastic-rounding AdamW       2 + 2 + 0 + 2 + 2 = 8
    fp32 + SGD with momentum                    4 + 4 + 0 + 4 = 12

    (params + grads + master + the optimizer's moments; 0-d counters and the delayed
    recipe's amax histories, 3 x 1024 f32 per FP8 matmul, are a fixed cost: "+ fixed bytes")

**Activations**: a stack of L of the transformer's ``Block``s (``studies.lib.models.Block``,
pre-LN attention + GELU MLP) under a policy, each block optionally wrapped in ``nn.remat``
(``jax.checkpoint``) with a policy from ``jax.checkpoint_policies``:

* ``none``: everything the backward pass needs is kept;
* ``full``: ``nothing_saveable``: only each block's input is kept, the block is recomputed
  in the backward pass (Korthikanti et al. 2022, "Reducing activation recomputation": 2sbh
  bytes per layer in 16-bit, i.e. B * T * d * itemsize; about one extra forward);
* ``dots``: ``dots_saveable``: matmul outputs kept, elementwise ops (norms, GELU, softmax)
  recomputed;
* ``dots_no_batch``: ``dots_with_no_batch_dims_saveable``: the projections' outputs kept,
  attention's QK^T / softmax / PV (batched matmuls, the T^2 part) recomputed: Megatron's
  "selective recomputation" idea.

Two measurements per (policy, remat, L):

* ``saved_bytes``: what JAX saves for the backward pass: the residuals of ``jax.vjp`` of the
  stack (read from ``jax.make_jaxpr``), excluding the ones that are inputs (the f32
  parameters and the stack's input, which are alive anyway). Exact and deterministic.
* XLA's compiled memory analysis of ``jax.jit(jax.grad(loss))`` (loss = sum of squares of the
  stack's output): ``temp_size_in_bytes`` (the peak of XLA's heap simulation: residuals plus
  the working set), argument and output sizes.

"Per layer" is the slope over the ``layers`` values (least squares), which cancels what does
not grow with depth. The residual slope is exact; the temp slope depends on where XLA's peak
falls and can be smaller than the saved bytes (the peak may sit in a phase where earlier
layers' residuals are already freed).

    fmtkit study memory [--batch 8 --seq-len 128] [--layers 2 3] [--remat none full dots]
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import flax.linen as nn
import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np
import optax

import fmtkit
from fmtkit import optim
from fmtkit.memory import ledger
from fmtkit.scaling import TensorScaling
from studies.lib.common import figure, format_table, no_progress, plot_style, save
from studies.lib.models import Block, TransformerConfig, TransformerLM, lm_loss

# How the command line lists this study (studies.app.registry).
NAME = "memory"
SUMMARY = "bytes per parameter per policy/optimizer; activations per layer with/without remat"
ORDER = 100

__all__ = ["REMAT", "STATE_ROWS", "Config", "Stack", "plot", "run", "saved_residual_bytes",
           "state_row", "summarize"]

REMAT: dict[str, Callable | None] = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_saveable,
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}
"""Rematerialization variants: name -> ``jax.checkpoint`` policy (``none``: no remat)."""


def _adamw(**kw: Any) -> optax.GradientTransformation:
    return optim.adamw(1e-3, **kw)


# name -> (description, policy preset, optimizer factory)
STATE_ROWS: dict[str, tuple[str, str, Callable[[], optax.GradientTransformation]]] = {
    "fp32-adamw": ("fp32, AdamW", "fp32", _adamw),
    "bf16-mixed-adamw": ("bf16-mixed (f32 params), AdamW", "bf16-mixed", _adamw),
    "fp8-delayed-adamw": ("fp8-delayed (f32 params, amax histories), AdamW", "fp8-delayed",
                          _adamw),
    "pure-bf16-adamw": ("pure-bf16, AdamW (bf16 moments)", "pure-bf16", _adamw),
    "bf16-master-adamw": ("pure-bf16, f32 master, AdamW", "pure-bf16",
                          lambda: optim.master_weights(_adamw())),
    "bf16-master-adamw-bf16m": ("pure-bf16, f32 master, AdamW bf16 moments", "pure-bf16",
                                lambda: optim.master_weights(
                                    _adamw(mu_dtype="bf16", nu_dtype="bf16"))),
    "bf16-master-adamw-fp8m": ("pure-bf16, f32 master, AdamW m e4m3 / v fp16 (MS-AMP O2)",
                               "pure-bf16",
                               lambda: optim.master_weights(_adamw(
                                   mu_dtype="e4m3", nu_dtype="fp16",
                                   nu_scaling=TensorScaling()))),
    "bf16-kahan-adamw": ("pure-bf16, Kahan-compensated AdamW", "pure-bf16",
                         lambda: optim.kahan_updates(_adamw())),
    "bf16-sr-adamw": ("pure-bf16, stochastic-rounding AdamW", "pure-bf16",
                      lambda: optim.stochastic_round_updates(_adamw())),
    "fp32-sgdm": ("fp32, SGD + momentum", "fp32", lambda: optax.sgd(1e-2, momentum=0.9)),
}
"""Rows of the model-state table."""


@dataclasses.dataclass(frozen=True)
class Config:
    """Configuration of the ``memory`` study.

    Attributes:
      d_model: model width (the state table's model and the activation stack).
      num_heads: attention heads.
      d_ff: MLP width.
      num_layers: layers of the model of the state table.
      batch: sequences per batch (activations).
      seq_len: tokens per sequence (activations).
      layers: depths L of the activation stack; per-layer figures are slopes over them
        (at least two distinct values).
      policies: policy presets of the activation measurements.
      remat: rematerialization variants (none, full, dots, dots_no_batch).
      state_rows: rows of the model-state table (see STATE_ROWS).
      compile: read XLA's memory analysis of the compiled gradient at every depth in
        ``layers`` ("all": gives the per-layer temp slope), only at the deepest ("deepest"),
        or not at all ("none": saved bytes only, no compiles).
    """

    d_model: int = 128
    num_heads: int = 4
    d_ff: int = 512
    num_layers: int = 2
    batch: int = 8
    seq_len: int = 128
    layers: tuple[int, ...] = (2, 3)
    policies: tuple[str, ...] = ("fp32", "bf16-mixed")
    remat: tuple[str, ...] = tuple(REMAT)
    state_rows: tuple[str, ...] = tuple(STATE_ROWS)
    compile: Literal["all", "deepest", "none"] = "all"

    def __post_init__(self):
        for name in ("d_model", "num_heads", "d_ff", "num_layers", "batch", "seq_len"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}.")
        if self.d_model % self.num_heads:
            raise ValueError(f"d_model={self.d_model} must be divisible by "
                             f"num_heads={self.num_heads}.")
        if len(set(self.layers)) < 2 or any(not isinstance(n, int) or n < 1
                                            for n in self.layers):
            raise ValueError(f"layers must hold at least two distinct positive ints, got "
                             f"{self.layers!r}.")
        presets = fmtkit.list_presets()
        for p in self.policies:
            if p not in presets:
                raise ValueError(f"policies: unknown preset {p!r}; valid: {', '.join(presets)}.")
        for r in self.remat:
            if r not in REMAT:
                raise ValueError(f"remat: unknown variant {r!r}; valid: {', '.join(REMAT)}.")
        if self.compile not in ("all", "deepest", "none"):
            raise ValueError(f"compile must be 'all', 'deepest' or 'none', got "
                             f"{self.compile!r}.")
        for r in self.state_rows:
            if r not in STATE_ROWS:
                raise ValueError(f"state_rows: unknown row {r!r}; valid: "
                                 f"{', '.join(STATE_ROWS)}.")

    def model_config(self, num_layers: int | None = None) -> TransformerConfig:
        """The transformer's configuration (f32; policies set the precisions)."""
        return TransformerConfig(d_model=self.d_model, num_heads=self.num_heads,
                                 d_ff=self.d_ff, max_len=self.seq_len,
                                 num_layers=num_layers or self.num_layers)


# ---------------------------------------------------------------------------------------------
# Model state


def _policy_trees(preset: str, config: Config) -> tuple[Any, Any, Any]:
    """(params, non-param variables, grads) of the policy-wrapped model, as shapes."""
    model = fmtkit.with_policy(TransformerLM(config.model_config()), preset)
    tokens = jax.ShapeDtypeStruct((1, config.seq_len), jnp.int32)
    variables = jax.eval_shape(model.init, jax.random.key(0), tokens)
    params = variables["params"]
    extra = {k: v for k, v in variables.items() if k != "params"}

    def loss(p, e):
        logits = model.apply({"params": p, **e}, jnp.zeros(tokens.shape, jnp.int32))
        return lm_loss(logits.astype(jnp.float32), jnp.zeros(tokens.shape, jnp.int32))

    return params, extra, jax.eval_shape(jax.grad(loss), params, extra)


def state_row(row: str, config: Config, _cache: dict | None = None) -> dict[str, Any]:
    """Bytes of params, grads, master copy and optimizer state for one ``STATE_ROWS`` row.

    The parameters come from ``jax.eval_shape`` of the policy-wrapped model's ``init`` (their
    dtypes are the policy's ``param_dtype``), the gradients from ``jax.eval_shape`` of
    ``jax.grad`` of the LM loss (their dtypes are JAX's), the optimizer state from
    ``fmtkit.memory.ledger`` (``jax.eval_shape(optimizer.init, params)``).
    """
    desc, preset, make_opt = STATE_ROWS[row]
    if _cache is not None and preset in _cache:
        params, extra, grads = _cache[preset]
    else:
        params, extra, grads = _policy_trees(preset, config)
        if _cache is not None:
            _cache[preset] = (params, extra, grads)
    with jax.numpy_dtype_promotion("standard"):
        led = ledger(params, make_opt())
    grad_bytes = sum(int(np.prod(g.shape)) * np.dtype(g.dtype).itemsize
                     for g in jax.tree.leaves(grads))
    n = led.num_params
    per = led.per_param()
    per["grads"] = grad_bytes / n
    per["total"] = per["params"] + per["grads"] + per["master"] + per["opt_state"]
    other = sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize
                for x in jax.tree.leaves(extra))
    return {
        "row": row, "description": desc, "policy": preset,
        "num_params": n, "param_bytes": led.param_bytes, "grad_bytes": grad_bytes,
        "master_bytes": led.master_bytes, "opt_state_bytes": led.opt_state_bytes,
        "scalar_bytes": led.scalar_bytes, "other_state_bytes": other,
        "param_dtypes": sorted({str(p.dtype) for p in jax.tree.leaves(params)}),
        "grad_dtypes": sorted({str(g.dtype) for g in jax.tree.leaves(grads)}),
        "bytes_per_param": per,
    }


# ---------------------------------------------------------------------------------------------
# Activations


class Stack(nn.Module):
    """``num_layers`` transformer ``Block``s on float activations ``[B, T, d]`` (causal mask),
    each wrapped in ``nn.remat`` with the ``remat`` variant's policy (``"none"``: not)."""

    cfg: TransformerConfig
    remat: str = "none"

    @nn.compact
    def __call__(self, x):
        mask = nn.make_causal_mask(jnp.ones(x.shape[:2], jnp.int32))
        policy = REMAT[self.remat]
        block = Block if self.remat == "none" else nn.remat(Block, policy=policy)
        for i in range(self.cfg.num_layers):
            x = block(self.cfg, name=f"Block_{i}")(x, mask)
        return x


def saved_residual_bytes(fn: Callable, *args: Any) -> int:
    """Bytes of what ``jax.vjp(fn, *args)`` saves for the backward pass, excluding residuals
    that are ``args`` themselves (or constants): the arrays the forward pass creates and
    keeps. Read from the jaxpr of the forward half (``jax.make_jaxpr``), each residual once.
    """
    closed = jax.make_jaxpr(lambda *a: jax.vjp(fn, *a)[1])(*args)
    jaxpr = closed.jaxpr
    inputs = set(jaxpr.invars) | set(jaxpr.constvars)
    seen: set = set()
    total = 0
    for v in jaxpr.outvars:
        if isinstance(v, jex.Literal) or v in inputs or v in seen:
            continue
        seen.add(v)
        total += int(np.prod(v.aval.shape)) * np.dtype(v.aval.dtype).itemsize
    return total


def _stack_measure(config: Config, policy: str, remat: str, num_layers: int,
                   compile_it: bool) -> dict[str, Any]:
    cfg = config.model_config(num_layers)
    model = fmtkit.with_policy(Stack(cfg, remat), policy)
    x = jax.ShapeDtypeStruct((config.batch, config.seq_len, config.d_model), jnp.float32)
    params = jax.eval_shape(model.init, jax.random.key(0), x)["params"]

    def forward(p, xs):
        return model.apply({"params": p}, xs)

    def loss(p, xs):
        return jnp.sum(jnp.square(forward(p, xs).astype(jnp.float32)))

    out: dict[str, Any] = {"layers": num_layers,
                           "saved_bytes": saved_residual_bytes(forward, params, x),
                           "param_bytes": sum(int(np.prod(p.shape)) * np.dtype(p.dtype).itemsize
                                              for p in jax.tree.leaves(params))}
    if compile_it:
        compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(params, x).compile()
        ma = compiled.memory_analysis()
        if ma is not None:
            out.update(temp_bytes=int(ma.temp_size_in_bytes),
                       argument_bytes=int(ma.argument_size_in_bytes),
                       output_bytes=int(ma.output_size_in_bytes))
    return out


def _slope(xs: list[int], ys: list[float]) -> float:
    return float(np.polyfit(np.asarray(xs, np.float64), np.asarray(ys, np.float64), 1)[0])


def run(config: Config, progress=no_progress) -> dict[str, Any]:
    """The model-state table and the activation measurements.

    Returns:
      ``{"state": [row dicts (state_row)], "activations": [{"policy", "remat",
      "per_layer": {"saved_bytes", "temp_bytes"}, "points": [per-L measurements]}], ...}``.
    """
    cache: dict = {}
    state = [state_row(r, config, cache) for r in progress(config.state_rows,
                                                           total=len(config.state_rows),
                                                           desc="state")]
    layers = sorted(set(config.layers))
    jobs = [(p, r) for p in config.policies for r in config.remat]
    acts = []
    for policy, remat in progress(jobs, total=len(jobs), desc="activations"):
        points = [_stack_measure(config, policy, remat, n,
                                 config.compile == "all" or (config.compile == "deepest"
                                                             and n == layers[-1]))
                  for n in layers]
        per_layer = {"saved_bytes": _slope(layers, [p["saved_bytes"] for p in points])}
        if all("temp_bytes" in p for p in points):
            per_layer["temp_bytes"] = _slope(layers, [p["temp_bytes"] for p in points])
        acts.append({"policy": policy, "remat": remat, "per_layer": per_layer,
                     "points": points})
    btd = config.batch * config.seq_len * config.d_model
    return {
        "num_params": state[0]["num_params"] if state else None,
        "state": state,
        "activations": acts,
        "layers": layers,
        "batch": config.batch, "seq_len": config.seq_len, "d_model": config.d_model,
        "d_ff": config.d_ff, "num_heads": config.num_heads,
        # One layer input, B*T*d elements: the unit of Korthikanti et al.'s "sbh".
        "btd": btd,
    }


def _mib(b: float) -> str:
    return f"{b / 2**20:.2f}"


def summarize(results: dict[str, Any]) -> str:
    """The bytes-per-parameter table and the per-layer activation table."""
    rows = []
    for r in results["state"]:
        per = r["bytes_per_param"]
        rows.append([r["description"], f"{per['params']:g}", f"{per['grads']:g}",
                     f"{per['master']:g}", f"{per['opt_state']:.4g}", f"{per['total']:.4g}",
                     f"{r['other_state_bytes'] + r['scalar_bytes']:,d}"])
    out = [format_table(["policy / optimizer", "params", "grads", "master", "opt state",
                         "total", "+ fixed bytes"], rows,
                        title=f"bytes per parameter ({results['num_params']:,} parameters)")]
    btd = results["btd"]
    rows = []
    for a in results["activations"]:
        pl = a["per_layer"]
        last = a["points"][-1]
        rows.append([a["policy"], a["remat"], _mib(pl["saved_bytes"]),
                     f"{pl['saved_bytes'] / btd:.2f}",
                     _mib(pl["temp_bytes"]) if "temp_bytes" in pl else "-",
                     _mib(last["temp_bytes"]) if "temp_bytes" in last else "-"])
    out.append(format_table(
        ["policy", "remat", "saved MiB/layer", "saved bytes/(B*T*d)", "XLA temp MiB/layer",
         f"XLA temp MiB (L={results['layers'][-1]})"], rows,
        title=(f"activations of the transformer block, B={results['batch']}, "
               f"T={results['seq_len']}, d={results['d_model']}, d_ff={results['d_ff']}")))
    return "\n\n".join(out)


_REMAT_COLORS = {"none": "#d62728", "full": "#2ca02c", "dots": "#ff7f0e",
                 "dots_no_batch": "#1f77b4"}


def plot(results: dict[str, Any], out_dir: Path) -> list[Path]:
    """``memory.png``: stacked bytes per parameter per row; saved and XLA-temp bytes per layer
    per policy and remat variant."""
    with plot_style():
        fig, (ax1, ax2) = figure(1, 2, width=12.5, height=4.6)
        state = results["state"]
        parts = [("params", "#1f77b4"), ("grads", "#ff7f0e"), ("master", "#2ca02c"),
                 ("opt_state", "#9467bd")]
        y = np.arange(len(state))
        left = np.zeros(len(state))
        for key, color in parts:
            vals = np.array([r["bytes_per_param"][key] for r in state])
            ax1.barh(y, vals, left=left, color=color, label=key.replace("_", " "))
            left += vals
        for yi, total in zip(y, left):
            ax1.text(total + 0.2, yi, f"{total:.3g}", va="center", fontsize=8)
        ax1.set_yticks(y, [r["description"] for r in state], fontsize=7)
        ax1.invert_yaxis()
        ax1.set_xlabel("bytes per parameter")
        ax1.set_title("training state per parameter")
        ax1.legend(loc="lower right")

        acts = results["activations"]
        policies = list(dict.fromkeys(a["policy"] for a in acts))
        remats = list(dict.fromkeys(a["remat"] for a in acts))
        width = 0.8 / max(len(remats), 1)
        for j, r in enumerate(remats):
            xs, saved, temp = [], [], []
            for i, p in enumerate(policies):
                a = next((a for a in acts if a["policy"] == p and a["remat"] == r), None)
                if a is None:
                    continue
                xs.append(i + (j - (len(remats) - 1) / 2) * width)
                saved.append(a["per_layer"]["saved_bytes"] / 2**20)
                temp.append(a["per_layer"].get("temp_bytes", np.nan) / 2**20)
            ax2.bar(xs, saved, width * 0.9, color=_REMAT_COLORS.get(r), label=f"{r}: saved")
            ax2.plot(xs, temp, "k_", ms=14, mew=2)
        ax2.plot([], [], "k_", ms=14, mew=2, label="XLA temp (slope)")
        ax2.set_xticks(range(len(policies)), policies)
        ax2.set_ylabel("MiB per layer")
        ax2.set_title(f"activations per layer (B={results['batch']}, T={results['seq_len']}, "
                      f"d={results['d_model']})")
        ax2.legend(fontsize=7)
        return [save(fig, out_dir, "memory")]
