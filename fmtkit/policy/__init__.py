"""Precision policies for unmodified Flax linen and NNX models and plain JAX functions.

``Policy`` holds a module's dtypes (params, compute, output, grad, reduce) and optionally an
FP8 recipe; ``Rules`` map module paths (or class names) to Policies, first match wins, plus
the output head's policy (found by role) and the model outputs' dtype; ``with_policy``
applies them **per operation**, autocast-style (``_ops`` has the op table, ``_engine`` the
mechanism: the traced jaxpr re-interpreted under the rules); ``module_paths`` lists the paths
to write rules against; ``inspect_policy`` reads back, from the jaxpr of the gradient, what
each op class of each module computed in, and lists every matmul and convolution with its
FLOPs and whether it ran under the policy (``MatmulOp``); ``intercept_gemms`` hands every
GEMM a policied call runs to a hook (``GemmSite``: what ``fmtkit.debug`` builds on).

This package is the only part of fmtkit that imports Flax, and it does so lazily: the
adapters are loaded when a model is first given.
"""

import warnings
from typing import TYPE_CHECKING

from fmtkit.policy._apply import module_paths, with_policy
from fmtkit.policy._engine.scopes import mark_head
from fmtkit.policy._gemm_hook import GemmSite, intercept_gemms
from fmtkit.policy._inspect import MatmulOp, ModuleReport, PolicyReport, inspect_policy
from fmtkit.policy._policy import (
    Policy,
    Rules,
    as_rules,
    describe_presets,
    get_preset,
    list_presets,
)

if TYPE_CHECKING:  # type checkers and the docs see it here; at run time it loads lazily
    from fmtkit.policy._frontends.nnx import DelayedScalingVariable
from fmtkit.policy._stack import find_stack, keep_blocks

__all__ = [
    "DelayedScalingVariable",
    "GemmSite",
    "MatmulOp",
    "ModuleReport",
    "Policy",
    "PolicyReport",
    "Rules",
    "as_rules",
    "describe_presets",
    "find_stack",
    "get_preset",
    "inspect_policy",
    "intercept_gemms",
    "keep_blocks",
    "list_presets",
    "mark_head",
    "module_paths",
    "with_policy",
]


def __getattr__(name: str):
    """The NNX Variable of delayed FP8 states loads Flax only when asked for (lazy, like the
    adapters); ``Fp8State`` is its deprecated former name."""
    if name in ("DelayedScalingVariable", "Fp8State"):
        from fmtkit.policy._frontends.nnx import DelayedScalingVariable

        if name == "Fp8State":
            warnings.warn(
                "fmtkit.policy.Fp8State is deprecated: use fmtkit.policy.DelayedScalingVariable "
                "(the NNX Variable holding a policied NNX model's delayed FP8 scaling states; "
                "fmtkit.DelayedScalingState is the state type of one matmul).",
                DeprecationWarning, stacklevel=2)
        return DelayedScalingVariable
    raise AttributeError(f"module 'fmtkit.policy' has no attribute {name!r}")
