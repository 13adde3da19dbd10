"""Study ``router-precision``: a Switch-style top-1 MoE LM with its router in bf16 vs f32.

Switch Transformer (Fedus et al. 2021, section 2.4, "Selective precision") trained its sparse
router in float32 inside an otherwise bfloat16 model: a bf16 router destabilized training,
and the router is cheap, so its input, logits and softmax run in f32 (seed 001: the router
"计算量很小，却会改变 token 的整个 expert path"). Here a small byte-level MoE transformer
(``studies.models.TransformerLM`` with ``num_experts`` experts per block, exact top-1
routing) is trained with ``studies.train`` under bf16-mixed, once per router variant:

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

    fmtkit study router-precision [--steps 150] [--num-experts 4] [--routers f32 bf16]
"""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from fmtkit.policy import Rules, get_preset
from studies._common import figure, format_table, no_progress, plot_style, save
from studies.models import TransformerConfig
from studies.training.config import TrainConfig

__all__ = [
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


def router_rules(router_policy: str) -> Rules:
    """bf16-mixed with ``router_policy`` on the routers (the first rule, so it wins)."""
    mixed = get_preset("bf16-mixed")
    return Rules([(ROUTER_PATTERN, router_policy), *mixed.rules], default=mixed.default,
                 check_unmatched=False)


def route_with_shadow(model: Any, variables: Any, *args: Any,
                      router_pattern: str = ROUTER_PATTERN) -> tuple[Any, list[dict]]:
    """Applies a linen MoE model and recomputes every router's top-1 assignment in f32.

    Each MoE layer (``studies.models.MoeBlock``) sows into ``"intermediates"`` the input its
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
      train: the training settings shared by every variant (num_layers: transformer
        blocks, each with an MoE; steps, batch, seq_len, lr,
        aux_loss_weight: the Switch load-balancing loss weight, Switch uses 0.01; seed: the
        same initialization and batches for every variant).
    """

    routers: tuple[str, ...] = ("f32", "bf16")
    num_experts: int = 4
    d_model: int = 64
    d_ff: int = 128
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
        if not isinstance(self.train, TrainConfig):
            raise TypeError(f"train must be a studies.train.TrainConfig, got "
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


def _make_measure(model: nn.Module, num_experts: int):
    @jax.jit
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


def run(config: Config, progress=no_progress) -> dict[str, Any]:
    """Trains each router variant and measures its assignments against the f32 shadow.

    Returns:
      ``{"variants": {name: {"loss": [...], "flip_frac": [...], "flip_frac_per_layer":
      [[...]], "aux_loss": [...], "max_load": [...], "final_fractions": [[...]], ...}}}``;
      per-step lists over ``steps``.
    """
    from studies import train

    tcfg = config.train_config()
    data = train.load_data(tcfg)
    e = config.num_experts
    out: dict[str, Any] = {"steps": tcfg.steps, "num_experts": e,
                           "num_layers": tcfg.num_layers, "variants": {}}
    for name in config.routers:
        setup = train.Setup(f"router-{name}", router_rules(ROUTERS[name]),
                            grad_format="bfloat16",
                            description=f"bf16-mixed, router {ROUTERS[name]}")
        init_fn, step_fn = train.make_train_step(setup, tcfg)
        measure = _make_measure(train.build_model(setup, tcfg), e)
        state = init_fn()
        hist: dict[str, list] = {"loss": [], "flip_frac": [], "flip_frac_per_layer": [],
                                 "aux_loss": [], "max_load": []}
        fractions = None
        for i in progress(range(tcfg.steps), total=tcfg.steps, desc=f"router {name}"):
            tokens = jnp.asarray(train.batch_at(data, tcfg, i))
            m = jax.device_get(measure(state.params, tokens))
            state, metrics = step_fn(state, tokens)
            loss = float(metrics["loss"])
            if not math.isfinite(loss):
                hist["loss"].append(loss)
                break
            hist["loss"].append(loss)
            hist["flip_frac"].append(float(np.mean(m["flips"])))
            hist["flip_frac_per_layer"].append([float(x) for x in m["flips"]])
            hist["aux_loss"].append(float(np.mean(m["aux"])))
            hist["max_load"].append(float(e * np.max(m["fractions"])))
            fractions = m["fractions"]
        k = max(1, len(hist["loss"]) // 10)
        out["variants"][name] = {
            **hist,
            "router_policy": ROUTERS[name],
            "final_loss": float(np.mean(hist["loss"][-k:])),
            "mean_flip_frac": float(np.mean(hist["flip_frac"])) if hist["flip_frac"] else 0.0,
            "final_fractions": np.asarray(fractions).tolist() if fractions is not None else [],
            "diverged": not math.isfinite(hist["loss"][-1]),
        }
    return out


def summarize(results: dict[str, Any]) -> str:
    """Per variant: final loss, flips vs the f32 shadow, load balance."""
    rows = []
    for name, v in results["variants"].items():
        k = max(1, len(v["flip_frac"]) // 10)
        rows.append([name, v["router_policy"], f"{v['final_loss']:.4f}",
                     f"{100 * v['mean_flip_frac']:.3f}%",
                     f"{100 * float(np.mean(v['flip_frac'][-k:])):.3f}%",
                     f"{float(np.mean(v['aux_loss'][-k:])):.4f}",
                     f"{float(np.mean(v['max_load'][-k:])):.3f}",
                     "yes" if v["diverged"] else "no"])
    return format_table(
        ["router", "router policy", "final loss", "flips (mean)", "flips (last 10%)",
         "aux loss", "max load", "diverged"], rows,
        title=(f"top-1 MoE, {results['num_experts']} experts x {results['num_layers']} layers, "
               f"{results['steps']} steps, bf16-mixed elsewhere; flips = assignments differing "
               "from an f32 shadow router"))


_COLORS = {"f32": "#1f77b4", "bf16": "#2ca02c"}


def plot(results: dict[str, Any], out_dir: Path) -> list[Path]:
    """``router_precision.png``: loss, flip fraction and load balance over the steps."""
    with plot_style():
        fig, axes = figure(1, 3, width=13.0, height=3.8)
        for name, v in results["variants"].items():
            c = _COLORS.get(name)
            axes[0].plot(v["loss"], color=c, label=f"router {name}")
            axes[1].plot([100 * f for f in v["flip_frac"]], color=c, label=f"router {name}")
            axes[2].plot(v["max_load"], color=c, label=f"router {name}: max load")
            axes[2].plot(v["aux_loss"], color=c, ls="--", label=f"router {name}: aux loss")
        axes[0].set_ylabel("loss (nats/byte)")
        axes[1].set_ylabel("assignments != f32 shadow (%)")
        axes[2].set_ylabel("E x max fraction / Switch aux loss")
        axes[2].axhline(1.0, color="k", lw=0.6)
        for ax in axes:
            ax.set_xlabel("step")
            ax.legend(fontsize=7)
        axes[1].set_title("router flips vs an f32 shadow router")
        return [save(fig, out_dir, "router_precision")]
