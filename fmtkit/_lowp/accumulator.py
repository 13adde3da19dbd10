"""A limited-precision accumulator, emulated: what a GEMM computes when its running sum keeps
fewer mantissa bits than f32 (Hopper's FP8 tensor cores keep about 14, DeepSeek-V3 section
3.3.2) and is promoted into f32 every so many elements of the contraction."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def _truncate_mantissa(x: jax.Array, bits: int) -> jax.Array:
    """Rounds f32 toward zero to ``bits`` mantissa bits (an accumulator's register width)."""
    mask = jnp.uint32((0xFFFFFFFF << (23 - bits)) & 0xFFFFFFFF)
    return lax.bitcast_convert_type(lax.bitcast_convert_type(x, jnp.uint32) & mask, jnp.float32)


def limited_precision_matmul(a: jax.Array, b: jax.Array, *, mantissa_bits: int,
                             promote_every: int | None = 128) -> jax.Array:
    """``a [M, C] · b [N, C]ᵀ`` with an emulated limited-precision accumulator.

    Products are exact in f32 (FP8 x FP8 needs 8 bits); the running sum is truncated to
    ``mantissa_bits`` after every addition, and every ``promote_every`` elements of C it is
    added into an f32 accumulator and restarted (DeepSeek-V3's promotion; None: never).
    Sequential over C, so meant for studies and tests, not training-size GEMMs.

    Example:
      >>> a, b = jnp.full((1, 4096), 1.0 + 2**-7), jnp.ones((1, 4096))    # exact sum: 4128
      >>> float(limited_precision_matmul(a, b, mantissa_bits=13, promote_every=None)[0, 0])
      4097.0
      >>> float(limited_precision_matmul(a, b, mantissa_bits=13)[0, 0])   # f32 every 128
      4128.0
    """
    a = a.astype(jnp.float32)
    b = b.astype(jnp.float32)
    m, c = a.shape
    n = b.shape[0]
    chunk = c if promote_every is None else promote_every
    if c % chunk:
        raise ValueError(f"contraction size {c} is not divisible by promote_every={chunk}.")

    def chunk_sum(carry, ab):
        ac, bc = ab  # [M, chunk], [N, chunk]

        def step(acc, k):
            prod = ac[:, k][:, None] * bc[:, k][None, :]
            return _truncate_mantissa(acc + prod, mantissa_bits), None

        part, _ = lax.scan(step, jnp.zeros((m, n), jnp.float32), jnp.arange(chunk))
        return carry + part, None

    a_chunks = a.reshape(m, c // chunk, chunk).transpose(1, 0, 2)
    b_chunks = b.reshape(n, c // chunk, chunk).transpose(1, 0, 2)
    out, _ = lax.scan(chunk_sum, jnp.zeros((m, n), jnp.float32), (a_chunks, b_chunks))
    return out
