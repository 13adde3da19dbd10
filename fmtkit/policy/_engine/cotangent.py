"""Cotangent rounding: a module's ``grad_dtype``, applied where a value leaves the module.

JAX ties a cotangent's dtype to its primal's, so the rounding of a module's incoming
gradient is an identity on the forward pass whose tangent is rounded (``round_cotangent``).
The interpreter wraps each floating value leaving a module in one (``round_on_exit``).
"""

from __future__ import annotations

import functools

import jax
import numpy as np

from fmtkit._switches import SWITCHES

GRAD_SCOPE = "fmtkit_grad_round_"
_F32 = np.dtype(np.float32)



@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def round_cotangent(x: jax.Array, dtype: str) -> jax.Array:
    """Identity on the forward pass; the tangent (so the cotangent) is rounded to ``dtype``.

    JAX ties a cotangent's dtype to its primal's, so ``grad_dtype`` is a rounding
    (``t.astype(dtype).astype(t.dtype)``), not a change of dtype. A custom JVP rather than a
    custom VJP, so ``jax.jvp`` and grad-of-grad work as well.
    """
    return x


@round_cotangent.defjvp
def _round_cotangent_jvp(dtype, primals, tangents):
    (x,), (t,) = primals, tangents
    with jax.named_scope(GRAD_SCOPE + str(dtype)):
        return x, t.astype(dtype).astype(t.dtype)


def round_on_exit(x: jax.Array, grad_dtype: np.dtype, rounded: tuple | None
                  ) -> tuple[jax.Array, tuple | None]:
    """``x`` rounded through ``grad_dtype`` on the backward pass as it leaves one module.

    ``rounded``: ``(value, dtype)`` last wrapped for the modules ``x`` left before (innermost
    first), or None. A value leaving nested modules with the same ``grad_dtype`` and no cast
    in between (the same array) is wrapped once, not once per module: rounding to a dtype is
    idempotent, so the gradients are bit-identical and the trace shorter. An f32
    ``grad_dtype``, or the value's own dtype, rounds nothing. Returns the value and the new
    ``rounded``.
    """
    gdt = np.dtype(grad_dtype)
    if (gdt != _F32 and gdt != x.dtype
            and not (SWITCHES.dedup_cotangent and rounded is not None
                     and rounded[0] is x and rounded[1] == gdt)):
        x = round_cotangent(x, grad_dtype)
        rounded = (x, gdt)
    return x, rounded
