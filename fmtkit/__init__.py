"""fmtkit: numerical-format research for JAX.

Exact formats and casts, scaling recipes, telemetry, precision policies for Flax, optax loss
scaling and master weights, FP8 matmuls and kernels, and studies.
"""

from fmtkit import distributed, fp4, fp8, memory, optim, telemetry
from fmtkit.casting import cast
from fmtkit.formats import FORMATS, Decomposition, Format, decompose, get_format
from fmtkit.policy import (
    Policy,
    Rules,
    get_preset,
    inspect_policy,
    list_presets,
    module_paths,
    with_policy,
)
from fmtkit.scaling import (
    AxisScaling,
    BlockScaling,
    DelayedScaling,
    DelayedScalingState,
    MXScaling,
    ScaledArray,
    TensorScaling,
    dequantize,
    qdq,
    quantize,
)

__version__ = "0.1.0"

__all__ = [
    "FORMATS",
    "AxisScaling",
    "BlockScaling",
    "Decomposition",
    "DelayedScaling",
    "DelayedScalingState",
    "Format",
    "MXScaling",
    "Policy",
    "Rules",
    "ScaledArray",
    "TensorScaling",
    "cast",
    "decompose",
    "dequantize",
    "distributed",
    "fp4",
    "fp8",
    "get_format",
    "get_preset",
    "inspect_policy",
    "list_presets",
    "memory",
    "module_paths",
    "optim",
    "qdq",
    "quantize",
    "telemetry",
    "with_policy",
]
