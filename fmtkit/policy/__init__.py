"""Precision policies for unmodified Flax linen and NNX models.

``Policy`` holds four dtypes (params, compute, output, grad); ``Rules`` map module paths (or
class names) to Policies, first match wins; ``with_policy`` applies them to a model;
``module_paths`` lists the paths to write rules against; ``inspect_policy`` reads back, from
the jaxpr, what each module computed in and the dtype of each parameter gradient.

This package is the only part of fmtkit that imports Flax, and it does so lazily: the
adapters are loaded when a model is first given.
"""

from fmtkit.policy._apply import module_paths, with_policy
from fmtkit.policy._inspect import ModuleReport, PolicyReport, inspect_policy
from fmtkit.policy._policy import (
    Policy,
    Rules,
    as_rules,
    describe_presets,
    get_preset,
    list_presets,
)

__all__ = [
    "Fp8DelayedDotGeneral",
    "Fp8State",
    "ModuleReport",
    "Policy",
    "PolicyReport",
    "Rules",
    "as_rules",
    "describe_presets",
    "get_preset",
    "inspect_policy",
    "list_presets",
    "module_paths",
    "with_policy",
]


def __getattr__(name: str):
    """The Flax-typed FP8 state holders load Flax only when asked for (lazy, like the adapters)."""
    if name == "Fp8DelayedDotGeneral":
        from fmtkit.policy._linen import Fp8DelayedDotGeneral

        return Fp8DelayedDotGeneral
    if name == "Fp8State":
        from fmtkit.policy._nnx import Fp8State

        return Fp8State
    raise AttributeError(f"module 'fmtkit.policy' has no attribute {name!r}")
