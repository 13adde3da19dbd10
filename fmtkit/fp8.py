"""FP8 training matmuls: a scaled ``dot_general`` with a custom VJP and named recipes.

Each of the three GEMMs of a linear layer receives real FP8 operands (FP8 arrays into
``lax.dot_general`` with ``preferred_element_type=f32``), each operand quantized along the
axis that GEMM contracts over:

    forward   y  = x  · w      contracts K        x tiles along K, w tiles along K
    dgrad     dx = dy · wᵀ     contracts N        dy tiles along N, w tiles along N
    wgrad     dw = xᵀ · dy     contracts tokens   x and dy tiles along the tokens

with the scales applied per block of the contraction (DeepSeek-V3's promotion into f32); off
GPUs the same products are computed from FP8 operands widened exactly to bf16.

Recipes (``RECIPES``; every field overridable with ``dataclasses.replace``):

    current    per tensor, just in time; E4M3 x/w, E5M2 gradients (TE "HYBRID")
    delayed    per tensor from an amax history (TE / Flax defaults: 1024, "max", margin 0),
               first step bootstrapped from the current amax; state threaded explicitly
    rowwise    one scale per row of each operand along the contraction (x rows, w columns)
    blockwise  DeepSeek-V3: 1x128 activations and gradients, 128x128 weights, E4M3 everywhere
    mxfp8      OCP MX: 1x32 tiles along the contraction with E8M0 power-of-two scales, E4M3

FP4 recipes (``fmtkit.fp4``: NVFP4, MXFP4) are ``Fp8Recipe`` subclasses and go wherever an
FP8 recipe goes: ``get_recipe``, ``dot_general_fn``, ``dot_general`` and ``init_state`` take
their names too.

This module and ``fmtkit.fp4`` are the two public faces of one private low-precision package,
``fmtkit._lowp`` (recipes and their tilings, operands, the GEMM, the FP8 and FP4 cores, their
autodiff, the grouped GEMM, the backend registry); both re-export its names.

Deprecated spellings (they warn with a ``DeprecationWarning`` naming the replacement):
``FP8Recipe`` (``Fp8Recipe``), ``Fp8DotState`` (``fmtkit.DelayedScalingState``) and the
factory form ``dot_general(recipe)`` (``dot_general_fn(recipe)``).
"""

from __future__ import annotations

import warnings
from typing import Any

from fmtkit._lowp.accumulator import limited_precision_matmul
from fmtkit._lowp.backends import (
    GemmBackend,
    gemm_backends,
    register_gemm_backend,
)
from fmtkit._lowp.backends import on_blackwell as on_blackwell
from fmtkit._lowp.dot import dot_general, dot_general_fn
from fmtkit._lowp.gemm import DGRAD_SCOPE as DGRAD_SCOPE
from fmtkit._lowp.gemm import PARTIALS_BUDGET_BYTES, scaled_matmul
from fmtkit._lowp.gemm import WGRAD_SCOPE as WGRAD_SCOPE
from fmtkit._lowp.gemm import WIDENED_SCOPE as WIDENED_SCOPE
from fmtkit._lowp.grouped import expert_block_layout, ragged_dot
from fmtkit._lowp.recipes import RECIPES, Fp8Recipe, get_recipe
from fmtkit._lowp.state import combine_observations, init_state, update_state
from fmtkit.scaling import DelayedScalingState as _DelayedScalingState

__all__ = [
    "PARTIALS_BUDGET_BYTES",
    "RECIPES",
    "Fp8Recipe",
    "GemmBackend",
    "combine_observations",
    "dot_general",
    "dot_general_fn",
    "expert_block_layout",
    "gemm_backends",
    "get_recipe",
    "init_state",
    "limited_precision_matmul",
    "ragged_dot",
    "register_gemm_backend",
    "scaled_matmul",
    "update_state",
]

_DEPRECATED: dict[str, tuple[Any, str]] = {
    "FP8Recipe": (Fp8Recipe, "fmtkit.fp8.Fp8Recipe (the same class)"),
    "Fp8DotState": (_DelayedScalingState,
                    "fmtkit.DelayedScalingState (the same class, the delayed-scaling state)"),
}


def __getattr__(name: str) -> Any:
    """The deprecated names of this module: each warns and returns its replacement."""
    if name in _DEPRECATED:
        value, replacement = _DEPRECATED[name]
        warnings.warn(f"fmtkit.fp8.{name} is deprecated: use {replacement}.",
                      DeprecationWarning, stacklevel=2)
        return value
    raise AttributeError(f"module 'fmtkit.fp8' has no attribute {name!r}")
