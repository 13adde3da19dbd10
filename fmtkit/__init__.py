"""fmtkit: numerical-format research for JAX.

Exact formats and casts, scaling recipes, telemetry, precision policies for Flax, optax loss
scaling and master weights, FP8 matmuls and kernels, and studies.
"""

from fmtkit import telemetry
from fmtkit.casting import cast
from fmtkit.formats import FORMATS, Decomposition, Format, decompose, get_format
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
    "ScaledArray",
    "TensorScaling",
    "cast",
    "decompose",
    "dequantize",
    "get_format",
    "qdq",
    "quantize",
    "telemetry",
]
