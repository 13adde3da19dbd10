"""The core protocol: the record of the three functions that define a low-precision GEMM core
(the FP8 core, the FP4 core, the grouped GEMM), from which ``fmtkit._lowp.autodiff`` builds
the differentiable ``core(recipe, out_dtype, x, w, extra)``.

A core computes ``y`` from ``x`` and ``w`` with the recipe's quantized GEMMs. ``extra`` is the
dense cores' f32 amax history (its cotangent: the observed amaxes) or an integer input (the
grouped GEMM's group sizes, whose tangent is none). The record says what autodiff needs:

    forward   (recipe, out_dtype, x, w, extra) -> (y, residuals)
    backward  (recipe, out_dtype, residuals, g, need) -> (dx, dw, dextra)
    operands  (recipe, residuals, M, N) -> (Q(x), Q(w))

and, for a core whose forward GEMM is no dense ``a · bᵀ``, that GEMM's product as a bilinear
map in f32 and its transposes (the defaults are the dense ones).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

_DIMS = (((1,), (1,)), ((), ()))  # a [F1, C] · b [F2, C]ᵀ


def _f32_matmul(a: jax.Array, b: jax.Array) -> jax.Array:
    """``a [F1, C] · b [F2, C]ᵀ`` in f32 (HIGHEST: every product and sum in f32)."""
    return jax.lax.dot_general(a.astype(jnp.float32), b.astype(jnp.float32), _DIMS,
                               precision=jax.lax.Precision.HIGHEST,
                               preferred_element_type=jnp.float32)


def dense_product(res: Any, a: jax.Array, b: jax.Array) -> jax.Array:
    """The dense cores' forward product ``a [M, K] · b [N, K]ᵀ`` in f32 (``res`` unused)."""
    del res
    return _f32_matmul(a, b)


def dense_transposes(res: Any, ct: jax.Array, a: jax.Array, b: jax.Array
                     ) -> tuple[jax.Array, jax.Array]:
    """``dense_product``'s transposes applied to ``ct [M, N]``: ``ct · b`` [M, K] (in ``a``)
    and ``ctᵀ · a`` [N, K] (in ``b``), in f32."""
    del res
    return _f32_matmul(ct, b.T), _f32_matmul(ct.T, a.T)


class Core(NamedTuple):
    """The functions that define a core (see the module docstring).

    Attributes:
      forward: ``forward(recipe, out_dtype, x, w, extra) -> (y, residuals)``: the forward
        GEMM, and what the backward GEMMs and the tangent read (a pytree of arrays).
      backward: ``backward(recipe, out_dtype, residuals, g, need) -> (dx, dw, dextra)``: the
        reverse-mode rule, the recipe's dgrad and wgrad. ``need`` holds one flag per
        differentiable input (``x``, ``w``, and a floating ``extra``) saying whether reverse
        mode asks its gradient; a core may return None for one not needed.
      operands: ``operands(recipe, residuals, M, N) -> (Q(x), Q(w))``: the forward GEMM's
        operands as it multiplied them (dequantized, f32; for the dense cores [M, K] and
        [N, K]), through which the forward-mode tangent runs.
      product: ``product(residuals, a, b)``, the forward GEMM's product as a bilinear map in
        f32 (default: the dense ``a · bᵀ``; the grouped GEMM: ``lax.ragged_dot`` with the
        group sizes it saves).
      transposes: ``transposes(residuals, ct, a, b) -> (ct_a, ct_b)``, ``product``'s
        transposes in each operand applied to ``ct``, in f32.
    """

    forward: Callable[..., tuple[jax.Array, Any]]
    backward: Callable[..., tuple[Any, Any, Any]]
    operands: Callable[..., tuple[jax.Array, jax.Array]]
    product: Callable[..., jax.Array] = dense_product
    transposes: Callable[..., tuple[jax.Array, jax.Array]] = dense_transposes
