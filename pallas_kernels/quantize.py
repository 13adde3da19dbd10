"""Fused blockwise FP8 (e4m3) quantizers for Hopper (Mosaic GPU), bit-identical to fmtkit.

``quantize_1x128(x)`` scales per row and 128 columns (DeepSeek-V3's activation tiles),
``quantize_128x128(w)`` per 128x128 block (its weight blocks). Each returns
``(values, scale)``: the same arrays as ``fmtkit.quantize(x, "e4m3",
BlockScaling(block, power_of_two=...))``'s ``.values`` and ``.scale``, bit for bit
(``tests/pallas_kernels/test_quantize.py``). The rule, from ``fmtkit/scaling.py``:

    amax   = max |x| over the block                         (f32; NaN if the block has one)
    scale  = amax * f32(1/448)                              (448: e4m3fn max, OCP FP8 v1.0)
    scale  = 1 where amax == 0, else max(scale, 2^-126)     (f32's smallest normal)
    scale  = 2^ceil(log2 scale)          if power_of_two    (DeepGEMM's ceil_to_ue8m0)
    values = cast(clip(x * (1 / scale), -448, 448), e4m3)   (f32 ops, nearest-even cast)

(products by reciprocals, as fmtkit writes them: XLA CPU rewrites divisions by a constant
into such products, so spelling them out keeps every backend identical).

One kernel pass reads x once and writes values and scales: each CTA takes 64 rows (1x128)
or 128 rows (128x128) and walks up to 4 column blocks, loading block c + 1 with TMA while it
quantizes block c in registers (amax by row/column reductions in the ``wgmma`` register
layout; the f32 -> e4m3 cast is ``cvt.rn.satfinite``, after the clip, so round-to-nearest-even
as XLA's).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from fmtkit.casting import check_floating
from fmtkit.formats import get_format
from fmtkit.scaling import BlockScaling, quantize
from pallas_kernels import _backend
from pallas_kernels._backend import Impl, pl, plgpu

__all__ = [
    "quantize_1x128",
    "quantize_1x128_reference",
    "quantize_128x128",
    "quantize_128x128_reference",
]

_BLOCK = 128  # DeepSeek-V3 (arXiv 2412.19437) §3.3.1: 1x128 and 128x128 tiles.
_E4M3 = get_format("e4m3")
_E4M3_MAX = float(_E4M3.max)  # 448 (OCP FP8 Formats v1.0, table 1)
_INV_E4M3_MAX = float(np.float32(1.0 / _E4M3_MAX))  # f32(1/448), as fmtkit rounds it
_F32_TINY = 2.0**-126  # smallest normal f32, fmtkit's scale floor
_KERNEL_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_ROWS_1X128 = 64  # one wgmma-layout row slab per CTA
_MAX_CHUNKS = 4  # column blocks per CTA
_SCALE_REPEAT = 4  # a 128x128 scale is written 4 times: a TMA copy moves >= 16 bytes


def _swizzled(dtype) -> tuple:
    bits = jnp.dtype(dtype).itemsize * 8
    return (plgpu.TilingTransform((8, 1024 // bits)), plgpu.SwizzleTransform(128))


def _ceil_pow2(s: jax.Array) -> jax.Array:
    """Rounds positive normal f32 up to a power of two on the bits; inf and NaN unchanged
    (equals fmtkit's frexp-based rule on every scale the rule can produce)."""
    bits = lax.bitcast_convert_type(s, jnp.uint32)
    exponent = bits & jnp.uint32(0x7F800000)
    up = lax.bitcast_convert_type(exponent + jnp.uint32(0x00800000), jnp.float32)
    keep = ((bits & jnp.uint32(0x007FFFFF)) == jnp.uint32(0)) | (
        exponent == jnp.uint32(0x7F800000))
    return jnp.where(keep, s, up)


def _scale_from_amax(amax: jax.Array) -> jax.Array:
    scale = amax * jnp.float32(_INV_E4M3_MAX)
    return jnp.where(amax == 0, jnp.float32(1.0), jnp.maximum(scale, jnp.float32(_F32_TINY)))


def _to_e4m3(x: jax.Array, inv_scale: jax.Array) -> jax.Array:
    v = x * inv_scale
    v = jnp.minimum(jnp.maximum(v, jnp.float32(-_E4M3_MAX)), jnp.float32(_E4M3_MAX))
    return v.astype(jnp.float8_e4m3fn)


# --------------------------------------------------------------------------------------
# Kernel bodies.


def _quantize_kernel(x_ref, v_ref, s_ref, x_smem, v_smem, s_smem, barriers, *, rows: int,
                     chunks: int, per_block: bool, power_of_two: bool):
    """``rows`` x (``chunks`` x 128) of x per CTA, double-buffered over the column blocks.

    1x128 (``per_block=False``): ``s_ref`` is [K/128, M] (scales transposed, so a CTA's
    scales for one column block are one contiguous row). 128x128: ``s_ref`` is
    [N/128, 4*K/128], each scale written 4 times.
    """
    i = lax.axis_index("rows")
    j = lax.axis_index("cols")
    row_slice = pl.ds(i * rows, rows)

    def cols(c):
        return pl.ds((j * chunks + c) * _BLOCK, _BLOCK)

    plgpu.copy_gmem_to_smem(x_ref.at[row_slice, cols(0)], x_smem.at[0], barriers.at[0])
    for c in range(chunks):
        slot = c % 2
        if c + 1 < chunks:
            plgpu.copy_gmem_to_smem(x_ref.at[row_slice, cols(c + 1)], x_smem.at[1 - slot],
                                    barriers.at[1 - slot])
        plgpu.barrier_wait(barriers.at[slot])
        x = x_smem[slot].astype(jnp.float32)
        row_amax = jnp.max(jnp.abs(x), axis=1)  # [rows], NaN-propagating (max.NaN.f32)
        if per_block:
            amax = jnp.max(row_amax, axis=0)
            # Scalar bit ops do not lower; do them on a splat vector and reduce it back.
            scale = jnp.broadcast_to(_scale_from_amax(amax), (_BLOCK,))
            if power_of_two:
                scale = _ceil_pow2(scale)
            scale = jnp.max(scale, axis=0)
            values = _to_e4m3(x, jnp.float32(1.0) / scale)
        else:
            scale = _scale_from_amax(row_amax)
            if power_of_two:
                scale = _ceil_pow2(scale)
            inv = jnp.float32(1.0) / scale
            values = _to_e4m3(x, lax.broadcast_in_dim(inv, x.shape, [0]))
        # At most the previous block's two stores may still read this slot's buffers.
        plgpu.wait_smem_to_gmem(2, wait_read_only=True)
        v_smem[slot] = values
        if per_block:
            for t in range(_SCALE_REPEAT):
                s_smem[slot, 0, t] = scale
        else:
            s_smem[slot, 0, :] = scale
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(v_smem.at[slot], v_ref.at[row_slice, cols(c)])
        col_block = j * chunks + c
        if per_block:
            plgpu.copy_smem_to_gmem(
                s_smem.at[slot],
                s_ref.at[pl.ds(i, 1), pl.ds(col_block * _SCALE_REPEAT, _SCALE_REPEAT)])
        else:
            plgpu.copy_smem_to_gmem(s_smem.at[slot], s_ref.at[pl.ds(col_block, 1), row_slice])
    plgpu.wait_smem_to_gmem(0)


def _chunks(kb: int) -> int:
    return next(c for c in (_MAX_CHUNKS, 2, 1) if kb % c == 0)


def _kernel_call(x2, *, per_block: bool, power_of_two: bool, impl: Impl):
    """x2: [R, K] with R a multiple of the CTA's rows. Returns (values, raw scales)."""
    r, k = x2.shape
    kb = k // _BLOCK
    rows = _BLOCK if per_block else _ROWS_1X128
    chunks = _chunks(kb)
    if per_block:
        s_type = jax.ShapeDtypeStruct((r // _BLOCK, kb * _SCALE_REPEAT), jnp.float32)
        s_smem = plgpu.SMEM((2, 1, _SCALE_REPEAT), jnp.float32)
    else:
        s_type = jax.ShapeDtypeStruct((kb, r), jnp.float32)
        s_smem = plgpu.SMEM((2, 1, rows), jnp.float32)
    kernel = plgpu.kernel(
        functools.partial(_quantize_kernel, rows=rows, chunks=chunks, per_block=per_block,
                          power_of_two=power_of_two),
        out_type=(jax.ShapeDtypeStruct((r, k), jnp.float8_e4m3fn), s_type),
        grid=(r // rows, kb // chunks),
        grid_names=("rows", "cols"),
        scratch_types=[
            plgpu.SMEM((2, rows, _BLOCK), x2.dtype, transforms=_swizzled(x2.dtype)),
            plgpu.SMEM((2, rows, _BLOCK), jnp.float8_e4m3fn,
                       transforms=_swizzled(jnp.float8_e4m3fn)),
            s_smem,
            plgpu.Barrier(num_barriers=2),
        ],
        interpret=_backend.interpret_params(impl),
        kernel_name="quantize_128x128" if per_block else "quantize_1x128",
    )
    return kernel(x2)


# --------------------------------------------------------------------------------------
# Validation and public API.


def _check(x, name: str, *, two_d: bool, power_of_two) -> jax.Array:
    x = check_floating(x, name)
    if not isinstance(power_of_two, bool):
        raise TypeError(f"power_of_two must be a bool, got {power_of_two!r}.")
    if two_d and x.ndim != 2:
        raise ValueError(f"{name} must be 2-D [N, K], got shape {x.shape}.")
    if x.ndim < 1 or x.shape[-1] % _BLOCK:
        raise ValueError(f"{name}.shape[-1] must be divisible by {_BLOCK}, got shape "
                         f"{x.shape}.")
    return x


@functools.partial(jax.jit, static_argnames=("power_of_two",))
def quantize_1x128_reference(x: jax.Array, *, power_of_two: bool = False
                             ) -> tuple[jax.Array, jax.Array]:
    """Pure-JAX ``quantize_1x128``: ``fmtkit.quantize(x, "e4m3", BlockScaling((1, 128)))``.

    Example:
      >>> values, scale = quantize_1x128_reference(jnp.full((2, 256), 896.0))
      >>> float(scale[0, 0]), float(values[0, 0])
      (2.0, 448.0)
    """
    x = _check(x, "x", two_d=False, power_of_two=power_of_two)
    k = x.shape[-1]
    # Rows flattened: fmtkit's (1, ..., 1, 128) blocks of an N-D x are the same tiles.
    sa = quantize(x.reshape(-1, k), _E4M3,
                  BlockScaling((1, _BLOCK), power_of_two=power_of_two))
    return sa.values.reshape(x.shape), sa.scale.reshape(*x.shape[:-1], k // _BLOCK)


@functools.partial(jax.jit, static_argnames=("power_of_two",))
def quantize_128x128_reference(w: jax.Array, *, power_of_two: bool = False
                               ) -> tuple[jax.Array, jax.Array]:
    """Pure-JAX ``quantize_128x128``: ``fmtkit.quantize(w, "e4m3", BlockScaling((128, 128)))``,
    extended to a last partial block of rows (zero rows do not change a block's amax).

    Example:
      >>> values, scale = quantize_128x128_reference(jnp.ones((200, 128)))
      >>> scale.shape
      (2, 1)
    """
    w = _check(w, "w", two_d=True, power_of_two=power_of_two)
    n = w.shape[0]
    pad = pl.cdiv(n, _BLOCK) * _BLOCK - n
    wp = jnp.pad(w, ((0, pad), (0, 0))) if pad else w
    sa = quantize(wp, _E4M3, BlockScaling((_BLOCK, _BLOCK), power_of_two=power_of_two))
    return sa.values[:n], sa.scale


@functools.partial(jax.jit, static_argnames=("power_of_two", "impl"))
def quantize_1x128(x: jax.Array, *, power_of_two: bool = False, impl: Impl = "auto"
                   ) -> tuple[jax.Array, jax.Array]:
    """Fused e4m3 quantization with one scale per row and 128 columns (DeepSeek-V3 tiles).

    Args:
      x: floating ``[..., K]`` (f32, bf16 and f16 run in the kernel; other floating dtypes
        use the reference); K divisible by 128.
      power_of_two: round scales up to powers of two (DeepGEMM's ``ceil_to_ue8m0``).
      impl: "auto", "kernel", "interpret", a ``plgpu.InterpretGPUParams``, or "reference"
        (see ``blockwise_fp8_matmul``).

    Returns:
      ``(values, scale)``: float8_e4m3fn ``[..., K]`` and float32 ``[..., K/128]``, equal
      bit for bit to ``fmtkit.quantize(x, "e4m3", BlockScaling((1, 128), power_of_two))``.

    Raises:
      TypeError: x is not floating point; power_of_two is not a bool.
      ValueError: K is not divisible by 128; an unknown ``impl``.

    Example:
      >>> values, scale = quantize_1x128(jnp.ones((4, 256)), impl="reference")
      >>> values.dtype, scale.shape
      (dtype(float8_e4m3fn), (4, 2))
    """
    x = _check(x, "x", two_d=False, power_of_two=power_of_two)
    kind = _backend.resolve_impl(impl)
    if kind == "reference" or jnp.dtype(x.dtype) not in _KERNEL_DTYPES:
        return quantize_1x128_reference(x, power_of_two=power_of_two)
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    r = x2.shape[0]
    rp = pl.cdiv(r, _ROWS_1X128) * _ROWS_1X128
    if rp != r:  # zero rows get scale 1 and are sliced away
        x2 = jnp.pad(x2, ((0, rp - r), (0, 0)))
    values, scale_t = _kernel_call(x2, per_block=False, power_of_two=power_of_two, impl=impl)
    values, scale = values[:r], scale_t.T[:r]
    return values.reshape(x.shape), scale.reshape(*lead, k // _BLOCK)


@functools.partial(jax.jit, static_argnames=("power_of_two", "impl"))
def quantize_128x128(w: jax.Array, *, power_of_two: bool = False, impl: Impl = "auto"
                     ) -> tuple[jax.Array, jax.Array]:
    """Fused e4m3 quantization with one scale per 128x128 block (DeepSeek-V3 weights).

    Args:
      w: floating ``[N, K]`` (f32, bf16 and f16 run in the kernel); K divisible by 128; N
        may end in a partial block (its scale covers the rows present).
      power_of_two: round scales up to powers of two.
      impl: as ``quantize_1x128``.

    Returns:
      ``(values, scale)``: float8_e4m3fn ``[N, K]`` and float32 ``[ceil(N/128), K/128]``,
      equal bit for bit to ``fmtkit.quantize(w, "e4m3", BlockScaling((128, 128),
      power_of_two))`` where N is a multiple of 128.

    Raises:
      TypeError: w is not floating point; power_of_two is not a bool.
      ValueError: w is not 2-D, K is not divisible by 128; an unknown ``impl``.

    Example:
      >>> values, scale = quantize_128x128(jnp.ones((256, 384)), impl="reference")
      >>> scale.shape
      (2, 3)
    """
    w = _check(w, "w", two_d=True, power_of_two=power_of_two)
    kind = _backend.resolve_impl(impl)
    if kind == "reference" or jnp.dtype(w.dtype) not in _KERNEL_DTYPES:
        return quantize_128x128_reference(w, power_of_two=power_of_two)
    n, k = w.shape
    np_ = pl.cdiv(n, _BLOCK) * _BLOCK
    wp = jnp.pad(w, ((0, np_ - n), (0, 0))) if np_ != n else w
    values, scale_rep = _kernel_call(wp, per_block=True, power_of_two=power_of_two, impl=impl)
    scale = scale_rep.reshape(np_ // _BLOCK, k // _BLOCK, _SCALE_REPEAT)[..., 0]
    return values[:n], scale
