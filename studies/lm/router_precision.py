"""Study ``router-precision``: a Switch-style top-1 MoE LM with its router in bf16 vs f32.

Switch Transformer (Fedus et al. 2021, section 2.4, "Selective precision") trained its sparse
router in float32 inside an otherwise bfloat16 model: a bf16 router destabilized training,
and the router is cheap, so its input, logits and softmax run in f32 (seed 001: the router
"计算量很小，却会改变 token 的整个 expert path"). Here a small byte-level MoE transformer
(``studies.lib.models.TransformerLM`` with ``num_experts`` experts per block, exact top-1
routing) is trained under bf16-mixed, once per router variant and seed (``--seeds``,
default 3; seed k of both variants starts from the same parameters and sees the same
batches):

* ``f32``:  the router's rule ``p=f32,c=f32`` (bf16-mixed's own choice): logits and softmax
  in f32 from the bf16 activations;
* ``bf16``: the router's rule ``p=f32,c=bf16``: the router matmul, its logits and the
  softmax in bf16 (8 significant bits: logits closer than about 2^-8 relative tie).

At every step, on the step's batch and the parameters before the update, an **f32 shadow
router** recomputes each layer's assignment from the router's actual input (recorded with
``flax.linen.intercept_methods``) and its f32 kernel:

    shadow = argmax(softmax(f32(x) @ kernel))       (the model's own top-1 rule, in f32)
    flip fraction = mean over layers and tokens of [expert_index != shadow]

With the f32 router the model computes exactly the shadow's arithmetic, so its flip fraction
is 0 by construction (a check of the measurement); with the bf16 router it is the share of
tokens whose expert differs from what f32 routing would pick. Also recorded per step: the
loss, the Switch load-balancing loss ``E * sum_e f_e P_e`` (1 when balanced; eq. 4) and the
largest expert load ``E * max_e f_e`` (1 when balanced).

The shadow needs the parameters before each update, so the seeds are not trained by
``studies.training.multiseed.train_seeds``: each seed's state comes from its own
``make_train_step(setup, cfg.with_seed(s), params=...)``, the states are stacked
(``studies.training.multiseed``) and one ``jax.jit(jax.vmap(...))`` of "measure, then step"
advances them all. Reported per variant, mean ± std over seeds: final loss, flips (mean over
the run and over its last 10%), aux loss and max load (last 10%); and the paired gaps bf16 - f32 of
those numbers with the 3-SE mark (``studies.lib.stats.compare(paired=True)``). The bf16 router
**measurably hurts** where a gap in loss, max load or aux loss (higher is worse for each)
is positive and significant.

``--grid`` instead trains every cell of a small grid (``--grid-lr``, ``--grid-experts``,
``--grid-steps``: by default lr 3e-3 / 1e-2 x 4 / 8 experts x 150 / 300 steps, the
conditions where a low-precision router is said to matter most: higher learning rates,
more experts to tie between, longer runs) and reports per cell the bf16 - f32 gaps and the
cells where the bf16 router measurably hurts ("none" otherwise).

    fmtkit study router-precision [--steps 150] [--seeds 3] [--num-experts 4]
                                  [--routers f32 bf16] [--grid]
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import re
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from fmtkit.policy import Rules, get_preset
from studies.lib import stats
from studies.lib.common import figure, format_table, no_progress, plot_style, save
from studies.lib.models import TransformerConfig
from studies.training import multiseed
from studies.training.config import TrainConfig
from studies.training.metrics import final_loss

# How the command line lists this study (studies.app.registry).
NAME = "router-precision"
SUMMARY = "top-1 MoE with its router in bf16 vs f32: flips vs an f32 shadow, balance"
ORDER = 120

__all__ = [
    "GAP_METRICS",
    "HARM_METRICS",
    "ROUTERS",
    "ROUTER_PATTERN",
    "Config",
    "plot",
    "route_with_shadow",
    "router_rules",
    "run",
    "summarize",
]

ROUTER_PATTERN = r"(^|/)router$"
"""Module paths of the routers (``Block_i/MoeBlock_0/router``)."""

ROUTERS = {"f32": "p=f32,c=f32", "bf16": "p=f32,c=bf16"}
"""Router variants: name -> the router's policy (the rest of the model is bf16-mixed)."""

GAP_METRICS = {"final_loss": "loss", "final_max_load": "max load",
               "final_aux_loss": "aux loss", "mean_flip_frac": "flips"}
"""Per-seed numbers compared bf16 - f32 (key of a seed's summary -> label)."""

HARM_METRICS = ("final_loss", "final_max_load", "final_aux_loss")
"""Where a significant positive gap means the bf16 router hurts (higher is worse for each;
flips are the mechanism, not a harm in themselves)."""


def router_rules(router_policy: str) -> Rules:
    """bf16-mixed with ``router_policy`` on the routers (the first rule, so it wins)."""
    mixed = get_preset("bf16-mixed")
    return Rules([(ROUTER_PATTERN, router_policy), *mixed.rules], default=mixed.default,
                 head=mixed.head, output_dtype=mixed.output_dtype, check_unmatched=False)


def route_with_shadow(model: Any, variables: Any, *args: Any,
                      router_pattern: str = ROUTER_PATTERN) -> tuple[Any, list[dict]]:
    """Applies a linen MoE model and recomputes every router's top-1 assignment in f32.

    Each MoE layer (``studies.lib.models.MoeBlock``) sows into ``"intermediates"`` the input its
    router received (as the policy computed it), the router's logits, the ``expert_index``
    it chose and its ``aux_loss``. The shadow assignment is
    ``argmax(softmax(f32(router_input) @ f32(kernel)))`` with the stored kernel: the same
    input, routed in f32.

    Args:
      model: a linen module (e.g. ``fmtkit.with_policy(TransformerLM(cfg), rules)``).
      variables: its variables (``{"params": ...}``).
      *args: the model's inputs.
      router_pattern: regex searched in the routers' module paths.

    Returns:
      ``(output, routers)``, ``routers`` a list (in path order) of dicts with ``path``,
      ``index`` (actual, int32), ``shadow`` (int32), ``aux_loss`` (f32 scalar or None) and
      ``logits_dtype``.

    Raises:
      ValueError: no router path matches ``router_pattern``.
    """
    rx = re.compile(router_pattern)
    out, state = model.apply(variables, *args, mutable=["intermediates"])
    found: list[tuple[tuple[str, ...], Any]] = []

    def visit(prefix, node):
        if "expert_index" in node:
            found.append((prefix, node))
        for key, child in node.items():
            if isinstance(child, dict) or hasattr(child, "items"):
                visit((*prefix, key), child)

    visit((), state["intermediates"])
    routers = []
    for prefix, node in found:
        path = "/".join((*prefix, "router"))
        if not rx.search(path):
            continue
        kernel = variables["params"]
        for part in (*prefix, "router", "kernel"):
            kernel = kernel[part]
        x = node["router_input"][0]
        logits = jax.lax.dot_general(x.astype(jnp.float32), kernel.astype(jnp.float32),
                                     (((x.ndim - 1,), (0,)), ((), ())))
        shadow = jnp.argmax(jax.nn.softmax(logits, axis=-1), axis=-1).astype(jnp.int32)
        aux = node["aux_loss"][0] if "aux_loss" in node else None
        routers.append({"path": path, "index": node["expert_index"][0].astype(jnp.int32),
                        "shadow": shadow, "aux_loss": aux,
                        "logits_dtype": str(node["router_logits"][0].dtype)})
    if not routers:
        raise ValueError(f"no router path matches router_pattern={router_pattern!r}.")
    return out, routers


@dataclasses.dataclass(frozen=True)
class Config:
    """Configuration of the ``router-precision`` study.

    Attributes:
      routers: router variants to train (f32: p=f32,c=f32; bf16: p=f32,c=bf16).
      num_experts: experts per MoE block (top-1 routing).
      d_model: model width.
      d_ff: expert MLP width.
      grid: train every (lr, experts, steps) cell of grid_lr x grid_experts x grid_steps
        instead of the one run of lr, num_experts, steps; report the bf16 - f32 gaps per
        cell.
      grid_lr: the grid's learning rates.
      grid_experts: the grid's experts per MoE block (each >= 2).
      grid_steps: the grid's run lengths.
      train: the training settings shared by every variant (num_layers: transformer
        blocks, each with an MoE; steps, batch, seq_len, lr,
        aux_loss_weight: the Switch load-balancing loss weight, Switch uses 0.01; seeds:
        seed k of every variant has the same initialization and batches).
    """

    routers: tuple[str, ...] = ("f32", "bf16")
    num_experts: int = 4
    d_model: int = 64
    d_ff: int = 128
    grid: bool = False
    grid_lr: tuple[float, ...] = (3e-3, 1e-2)
    grid_experts: tuple[int, ...] = (4, 8)
    grid_steps: tuple[int, ...] = (150, 300)
    train: TrainConfig = TrainConfig(steps=150, warmup=20, num_layers=2)

    def __post_init__(self):
        if not self.routers or any(r not in ROUTERS for r in self.routers):
            raise ValueError(f"routers must be a non-empty subset of {tuple(ROUTERS)}, got "
                             f"{self.routers!r}.")
        for name in ("num_experts", "d_model", "d_ff"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}.")
        if self.d_model % 4:
            raise ValueError(f"d_model must be a multiple of the 4 attention heads, got "
                             f"{self.d_model}.")
        if self.num_experts < 2:
            raise ValueError(f"num_experts must be >= 2, got {self.num_experts}.")
        for name, lo in (("grid_lr", None), ("grid_experts", 2), ("grid_steps", 1)):
            vals = getattr(self, name)
            ok = isinstance(vals, tuple) and bool(vals) and len(set(vals)) == len(vals)
            for v in vals if ok else ():
                if lo is None:
                    ok = ok and isinstance(v, (int, float)) and not isinstance(v, bool) \
                        and math.isfinite(v) and v > 0
                else:
                    ok = ok and isinstance(v, int) and not isinstance(v, bool) and v >= lo
            if not ok:
                what = "numbers > 0" if lo is None else f"ints >= {lo}"
                raise ValueError(f"{name} must be a non-empty tuple of distinct {what}, got "
                                 f"{vals!r}.")
        if not isinstance(self.train, TrainConfig):
            raise TypeError(f"train must be a studies.training.TrainConfig, got "
                            f"{type(self.train).__name__}.")
        if self.train.num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {self.train.num_layers}.")

    def train_config(self) -> TrainConfig:
        """``train`` with the MoE model of this study."""
        model = TransformerConfig(d_model=self.d_model, num_heads=4,
                                  num_layers=self.train.num_layers,
                                  d_ff=self.d_ff, max_len=self.train.seq_len,
                                  num_experts=self.num_experts)
        return dataclasses.replace(self.train, model=model)

    def cells(self) -> list[Config]:
        """The runs: this config (no grid), or one per (lr, experts, steps) grid cell."""
        if not self.grid:
            return [self]
        return [dataclasses.replace(self, grid=False, num_experts=e,
                                    train=dataclasses.replace(self.train, lr=lr, steps=n))
                for lr, e, n in itertools.product(self.grid_lr, self.grid_experts,
                                                  self.grid_steps)]


def _make_measure(model: nn.Module, num_experts: int):
    """``(params, tokens) -> {"flips": [layers], "fractions": [layers, E], "aux":
    [layers]}`` for one seed (unjitted: it is vmapped with the step)."""
    def measure(params, tokens):
        _, routers = route_with_shadow(model, {"params": params}, tokens)
        flips = jnp.stack([jnp.mean(r["index"] != r["shadow"], dtype=jnp.float32)
                           for r in routers])
        frac = jnp.stack([jnp.mean(jax.nn.one_hot(r["index"].reshape(-1), num_experts,
                                                  dtype=jnp.float32), axis=0)
                          for r in routers])  # [layers, E]
        aux = jnp.stack([r["aux_loss"] for r in routers])
        return {"flips": flips, "fractions": frac, "aux": aux}

    return measure


def _measured_step(step_fn, measure):
    """One seed's step that first measures the routers on the parameters before the
    update (the step's own batch)."""
    def step(state, tokens):
        m = measure(state.params, tokens)
        state, metrics = step_fn(state, tokens)
        return state, {"loss": metrics["loss"], **m}

    return step


def _seed_summary(seed: int, hist: dict[str, list], fractions: Any,
                  diverged_at: int | None) -> dict[str, Any]:
    last = final_loss  # mean of the last 10% of a curve
    return {
        "seed": seed, **hist,
        "final_loss": float("nan") if diverged_at is not None else last(hist["loss"]),
        "mean_flip_frac": float(np.mean(hist["flip_frac"])) if hist["flip_frac"] else 0.0,
        "final_flip_frac": last(hist["flip_frac"]),
        "final_aux_loss": last(hist["aux_loss"]),
        "final_max_load": last(hist["max_load"]),
        "final_fractions": np.asarray(fractions).tolist() if fractions is not None else [],
        "diverged_at": diverged_at,
    }


def _train_variant(name: str, tcfg: TrainConfig, data: np.ndarray, params: list[Any],
                   progress) -> dict[str, Any]:
    """Every seed of one router variant, stacked and stepped by one vmapped step."""
    from studies import training

    setup = training.Setup(f"router-{name}", router_rules(ROUTERS[name]),
                        grad_format="bfloat16",
                        description=f"bf16-mixed, router {ROUTERS[name]}")
    seeds = tcfg.seed_list
    states, step_fn = [], None
    for s, p in zip(seeds, params):
        init_fn, fn = training.make_train_step(setup, tcfg.with_seed(s), params=p)
        step_fn = step_fn or fn  # nothing seed-dependent is a constant of the step
        states.append(init_fn())
    state = multiseed.stack(states)
    e = tcfg.model_config().num_experts
    vstep = multiseed.vmap_step(_measured_step(
        step_fn, _make_measure(training.build_model(setup, tcfg), e)))
    keys = ("loss", "flip_frac", "flip_frac_per_layer", "aux_loss", "max_load")
    hists = [{k: [] for k in keys} for _ in seeds]
    fractions: list[Any] = [None] * len(seeds)
    diverged_at: list[int | None] = [None] * len(seeds)
    for i in progress(range(tcfg.steps), total=tcfg.steps, desc=f"router {name}"):
        state, m = vstep(state, multiseed.stack_batches(data, tcfg, i))
        m = jax.device_get(m)
        for j, h in enumerate(hists):
            if diverged_at[j] is not None:
                continue
            loss = float(m["loss"][j])
            h["loss"].append(loss)
            if not math.isfinite(loss):
                diverged_at[j] = i
                continue
            h["flip_frac"].append(float(np.mean(m["flips"][j])))
            h["flip_frac_per_layer"].append([float(x) for x in m["flips"][j]])
            h["aux_loss"].append(float(np.mean(m["aux"][j])))
            h["max_load"].append(float(e * np.max(m["fractions"][j])))
            fractions[j] = m["fractions"][j]
        if all(d is not None for d in diverged_at):
            break
    per_seed = [_seed_summary(s, h, f, d)
                for s, h, f, d in zip(seeds, hists, fractions, diverged_at)]
    out = {"router_policy": ROUTERS[name], "seeds": list(seeds), "per_seed": per_seed,
           "diverged": sum(d is not None for d in diverged_at)}
    for key in (*GAP_METRICS, "final_flip_frac"):
        out[key] = [p[key] for p in per_seed]
    return out


def _run_cell(config: Config, data: np.ndarray, progress) -> dict[str, Any]:
    """Every variant of one config; the paired bf16 - f32 gaps when both ran."""
    tcfg = config.train_config()
    params = multiseed.seed_params(tcfg)  # seed k of every variant starts from these
    variants = {name: _train_variant(name, tcfg, data, params, progress)
                for name in config.routers}
    cell: dict[str, Any] = {"lr": tcfg.lr, "num_experts": config.num_experts,
                            "steps": tcfg.steps, "variants": variants, "gaps": {},
                            "hurts": None}
    if {"f32", "bf16"} <= variants.keys():
        gaps = {k: stats.compare(variants["f32"][k], variants["bf16"][k], paired=True)
                for k in GAP_METRICS}
        cell["gaps"] = {k: g.to_dict() for k, g in gaps.items()}
        cell["hurts"] = [GAP_METRICS[k] for k in HARM_METRICS
                         if gaps[k].significant and gaps[k].gap > 0]
    return cell


def run(config: Config, progress=no_progress) -> dict[str, Any]:
    """Trains each router variant (every seed; every grid cell with ``grid``) and measures
    its assignments against the f32 shadow.

    Returns:
      ``{"cells": [{"lr", "num_experts", "steps", "variants": {name: {"per_seed": [{"loss":
      [...], "flip_frac": [...], "flip_frac_per_layer": [[...]], "aux_loss": [...],
      "max_load": [...], "final_fractions": [[...]], "final_loss", ...}], "final_loss":
      [per seed], ...}}, "gaps": {metric: stats.Gap.to_dict}, "hurts": [labels] or None}],
      "grid": bool, ...}``: one cell without ``grid``; per-step lists over ``steps``.
    """
    from studies import training

    tcfg = config.train_config()
    data = training.load_data(tcfg)  # the same bytes for every cell
    cells = [_run_cell(c, data, progress) for c in config.cells()]
    return {"grid": config.grid, "seeds": list(tcfg.seed_list),
            "num_layers": tcfg.num_layers, "d_model": config.d_model, "cells": cells}


def _gap_cell(d: dict[str, Any], scale: float = 1.0) -> str:
    """``format_gap`` in the values' units (times ``scale``)."""
    g = stats.compare([scale * v for v in d["reference"]["values"]],
                      [scale * v for v in d["candidate"]["values"]],
                      threshold=d["threshold"], paired=d["paired"])
    return stats.format_gap(g, relative=False)


def _gap_cells(cell: dict[str, Any]) -> list[str]:
    return [_gap_cell(cell["gaps"][k], 100.0 if k == "mean_flip_frac" else 1.0)
            for k in GAP_METRICS]


def _hurts(cell: dict[str, Any]) -> str:
    return "-" if cell["hurts"] is None else (", ".join(cell["hurts"]) or "no")


def summarize(results: dict[str, Any]) -> str:
    """Per variant: final loss, flips vs the f32 shadow, load balance (mean ± std over
    seeds), and the bf16 - f32 gaps; with ``grid``, one row of gaps per cell."""
    ms = stats.format_mean_std
    seeds = results["seeds"]
    gap_head = ["loss", "max load", "aux loss", "flips (pp)"]
    if results["grid"]:
        rows = [[f"{c['lr']:g}", str(c["num_experts"]), str(c["steps"]), *_gap_cells(c),
                 _hurts(c)] for c in results["cells"] if c["gaps"]]
        bad = [f"lr {c['lr']:g}, {c['num_experts']} experts, {c['steps']} steps "
               f"({', '.join(c['hurts'])})" for c in results["cells"] if c["hurts"]]
        out = [format_table(
            ["lr", "experts", "steps", *(f"{h}: bf16 - f32" for h in gap_head),
             "bf16 hurts"], rows,
            title=(f"router grid: top-1 MoE x {results['num_layers']} layers, d_model "
                   f"{results['d_model']}, seeds {seeds}, bf16-mixed elsewhere")),
            "cells where the bf16 router measurably hurts: " + ("; ".join(bad) or "none")]
    else:
        (c,) = results["cells"]
        rows = []
        for name, v in c["variants"].items():
            rows.append([name, v["router_policy"], ms(v["final_loss"]),
                         ms([100 * x for x in v["mean_flip_frac"]]),
                         ms([100 * x for x in v["final_flip_frac"]]),
                         ms(v["final_aux_loss"]), ms(v["final_max_load"]),
                         f"{v['diverged']}/{len(v['seeds'])}"])
        out = [format_table(
            ["router", "router policy", "final loss", "flips % (mean)",
             "flips % (last 10%)", "aux loss", "max load", "diverged"], rows,
            title=(f"top-1 MoE, {c['num_experts']} experts x {results['num_layers']} "
                   f"layers, {c['steps']} steps, lr {c['lr']:g}, seeds {seeds}, "
                   "bf16-mixed elsewhere; flips = assignments differing from an f32 shadow "
                   "router"))]
        if c["gaps"]:
            out.append("bf16 - f32: " + ", ".join(
                f"{h} {g}" for h, g in zip(gap_head, _gap_cells(c))))
            out.append("bf16 router measurably hurts: " + (", ".join(c["hurts"]) or "none"))
    out += ["loss: mean of the last 10% of the steps (nats/byte); aux loss and max load: "
            "the same window; flips (pp): the run's mean flip share, in percentage points.",
            "bf16 hurts: a significant positive gap in loss, max load or aux loss.",
            stats.PAIRED_NOTE]
    return "\n".join(out)


_COLORS = {"f32": "#1f77b4", "bf16": "#2ca02c"}


def plot(results: dict[str, Any], out_dir: Path) -> list[Path]:
    """``router_precision.png``: loss, flip fraction and max load over the steps (mean ±
    std over seeds); ``router_gaps.png``: the bf16 - f32 gaps (relative to f32, ±3 SE) of
    loss, max load and aux loss, per grid cell with ``grid``."""
    paths = []
    if not results["grid"]:
        (c,) = results["cells"]
        with plot_style():
            fig, axes = figure(1, 3, width=13.0, height=3.8)
            for name, v in c["variants"].items():
                for ax, key, scale in ((axes[0], "loss", 1.0), (axes[1], "flip_frac", 100.0),
                                       (axes[2], "max_load", 1.0)):
                    curves = [[scale * x for x in p[key]] for p in v["per_seed"]]
                    n = min(len(x) for x in curves)
                    if n:
                        stats.band(ax, np.arange(n), [x[:n] for x in curves],
                                   color=_COLORS.get(name), label=f"router {name}",
                                   smooth=5)
            axes[0].set_ylabel("loss (nats/byte)")
            axes[1].set_ylabel("assignments != f32 shadow (%)")
            axes[2].set_ylabel("E x max expert fraction")
            axes[2].axhline(1.0, color="k", lw=0.6)
            for ax in axes:
                ax.set_xlabel("step")
                ax.legend(fontsize=7)
            axes[1].set_title(f"router flips vs an f32 shadow router, seeds {results['seeds']}")
            paths.append(save(fig, out_dir, "router_precision"))
    gaps = {}
    for c in results["cells"]:
        where = (f"lr {c['lr']:g}, E {c['num_experts']}, {c['steps']} st: "
                 if results["grid"] else "")
        for k in HARM_METRICS:
            if k in c["gaps"]:
                gaps[where + GAP_METRICS[k]] = stats.Gap.from_dict(c["gaps"][k])
    if gaps:
        paths.append(stats.plot_gap_bars(
            gaps, out_dir, "router_gaps",
            title="bf16 router - f32 router, % of f32 (paired, ±3 SE)"))
    return paths
