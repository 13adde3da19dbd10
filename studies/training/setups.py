"""Training setups: what one row of a precision ablation means, and the registry of them.

A setup is a policy (``fmtkit.with_policy`` preset or ``Rules``), how parameters are stored
and updated (plain optax updates, f32 master weights, stochastic rounding or Kahan
compensation of low-precision updates) and whether the loss is scaled.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import fmtkit
from fmtkit.fp8 import Fp8Recipe
from fmtkit.policy import Rules, as_rules

__all__ = ["DEFAULT_SETUPS", "FP4_SETUPS", "SETUPS", "Setup", "get_setup"]


@dataclasses.dataclass(frozen=True)
class Setup:
    """One training setup: a precision policy plus parameter storage/update and loss scaling.

    Attributes:
      name: short name (a row of the ablation table).
      policy: a ``fmtkit.with_policy`` preset name (``fmtkit.list_presets()``), a policy
        string or ``Rules``. The policy's ``param_dtype`` is the parameter storage.
      update: how updates reach the parameters: "plain" (``optax.apply_updates``: the sum is
        rounded to the parameter dtype, so small updates to bf16 weights vanish),
        "master" (``fmtkit.optim.master_weights``: f32 masters, params = round(master)),
        "stochastic" (``fmtkit.optim.stochastic_round_updates``) or "kahan"
        (``fmtkit.optim.kahan_updates``).
      loss_scaling: "none", "dynamic" (``fmtkit.optim.dynamic_loss_scale``, PyTorch
        GradScaler defaults unless overridden below) or "static".
      init_scale: initial (dynamic) or constant (static) loss scale.
      growth_interval: finite steps before the dynamic scale grows (PyTorch: 2000).
      grad_format: the format whose flush-to-zero of gradient values ``grad_flush`` reports
        (the policy's gradient dtype: "float16" for fp16 policies).
      may_diverge: a non-finite loss ends this setup's run as "diverged" instead of raising
        ``StudyError``.
      description: one line for tables and --help.
      keep_last: the last blocks of the layer stack kept out of the policy's FP8/FP4 recipe
        (``fmtkit.policy.keep_blocks``: by position, as the NVFP4 paper keeps its last
        blocks in BF16); the model needs more blocks than this.
    """

    name: str
    policy: str | Rules
    update: Literal["plain", "master", "stochastic", "kahan"] = "plain"
    loss_scaling: Literal["none", "dynamic", "static"] = "none"
    init_scale: float = 2.0**16
    growth_interval: int = 2000
    grad_format: str = "float32"
    may_diverge: bool = False
    description: str = ""
    keep_last: int = 0

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"name must be a non-empty str, got {self.name!r}.")
        if isinstance(self.keep_last, bool) or not isinstance(self.keep_last, int) or \
                self.keep_last < 0:
            raise ValueError(f"keep_last must be an int >= 0, got {self.keep_last!r}.")
        if self.update not in ("plain", "master", "stochastic", "kahan"):
            raise ValueError(f"update must be 'plain', 'master', 'stochastic' or 'kahan', got "
                             f"{self.update!r}.")
        if self.loss_scaling not in ("none", "dynamic", "static"):
            raise ValueError(f"loss_scaling must be 'none', 'dynamic' or 'static', got "
                             f"{self.loss_scaling!r}.")
        fmtkit.get_format(self.grad_format)  # ValueError listing the formats
        as_rules(self.policy)  # ValueError on an unknown preset or a bad policy string

    def rules(self) -> Rules:
        """The policy as ``Rules``."""
        return as_rules(self.policy)

    def fp8_recipes(self) -> tuple[Fp8Recipe, ...]:
        """The FP8 recipes the policy's rules use (empty for none)."""
        rules = self.rules()
        pols = [p for _, p in rules.rules] + [rules.default]
        return tuple(dict.fromkeys(p.fp8 for p in pols if getattr(p, "fp8", None) is not None))


def _setups() -> dict[str, Setup]:
    s = [
        Setup("fp32", "fp32", grad_format="float32",
              description="everything f32 (the reference), AdamW"),
        Setup("bf16-mixed", "bf16-mixed", grad_format="bfloat16",
              description="f32 params, bf16 compute/activations/gradients, AdamW"),
        Setup("pure-bf16", "pure-bf16", grad_format="bfloat16",
              description="bf16 params and moments, AdamW updates rounded to bf16 "
                          "(small updates vanish)"),
        Setup("pure-bf16-sr", "pure-bf16", update="stochastic", grad_format="bfloat16",
              description="bf16 params, updates stochastically rounded to bf16"),
        Setup("pure-bf16-kahan", "pure-bf16", update="kahan", grad_format="bfloat16",
              description="bf16 params, Kahan-compensated updates (bf16 buffer)"),
        Setup("bf16-master", "pure-bf16", update="master", grad_format="bfloat16",
              description="bf16 params and compute, f32 master weights and moments"),
        Setup("fp16", "fp16-mixed", grad_format="float16", may_diverge=True,
              description="f32 params, fp16 compute/gradients, no loss scaling"),
        Setup("fp16-dynamic", "fp16-mixed", loss_scaling="dynamic", grad_format="float16",
              description="f32 params, fp16 compute, dynamic loss scaling (from 2^16)"),
    ]
    for recipe in ("current", "delayed", "rowwise", "blockwise", "mxfp8"):
        s.append(Setup(f"fp8-{recipe}", f"fp8-{recipe}", grad_format="bfloat16",
                       description=f"bf16-mixed + FP8 {recipe} recipe on the linear layers"))
    for recipe, what in (("nvfp4", "NVFP4 (RHT, SR gradients, 16x16 weights)"),
                         ("nvfp4-no-rht", "NVFP4 without the random Hadamard transform"),
                         ("nvfp4-no-sr", "NVFP4 with RNE gradients (no SR)"),
                         ("nvfp4-no-2d", "NVFP4 with 1x16 weight blocks (no 2D)"),
                         ("mxfp4", "MXFP4 (E8M0 32-blocks, RHT, SR gradients)")):
        s.append(Setup(recipe, recipe, grad_format="bfloat16", keep_last=1,
                       description=f"bf16-mixed + {what}; last block in BF16"))
    s.append(Setup("nvfp4-all-layers", "nvfp4", grad_format="bfloat16",
                   description="bf16-mixed + NVFP4 on every block's linear layers"))
    return {x.name: x for x in s}


SETUPS: dict[str, Setup] = _setups()
"""The registered setups (what ``fmtkit ablate --policies`` accepts), in table order."""

FP4_SETUPS: tuple[str, ...] = ("nvfp4", "nvfp4-no-rht", "nvfp4-no-sr", "nvfp4-no-2d",
                                "nvfp4-all-layers", "mxfp4")
"""The FP4 setups (``fmtkit.fp4``); their model needs a stack of blocks (``keep_last``)."""

DEFAULT_SETUPS: tuple[str, ...] = tuple(n for n in SETUPS if n not in FP4_SETUPS)
"""The registered setups but the FP4 ones: what ``fmtkit ablate --regime NAME`` trains
when no policies are given (the fp4-training regime has its own list)."""


def get_setup(name: str | Setup) -> Setup:
    """The registered setup called ``name`` (a ``Setup`` is returned unchanged).

    Raises:
      ValueError: unknown name (the message lists the valid ones).
    """
    if isinstance(name, Setup):
        return name
    if not isinstance(name, str) or name not in SETUPS:
        raise ValueError(f"unknown setup (policy) {name!r}; valid: {', '.join(SETUPS)}.")
    return SETUPS[name]
