"""Operands of the low-precision GEMMs: quantized ``[free, contraction]`` operands, padding
and transposes.

An operand is quantized with its recipe's tiling (``Tile``, owned by the recipes: see
``fmtkit._lowp.recipes``). Each dimension that a tiling blocks is zero-padded inside the GEMM
that needs it (a GEMM of ``a [F1, C]`` and ``b [F2, C]`` pads C to both operands' contraction
blocks and each F to its operand's free block) and the result is sliced back, so any shape
trains. Padding is exact: zeros never raise a block's amax, an all-zero block gets scale 1 and
zero values, and padded rows and columns contribute zero products.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from fmtkit._lowp.recipes import Fp8Recipe, Tile, scaling_of
from fmtkit.formats import get_format
from fmtkit.scaling import ScaledArray, TensorScaling, keep_nonfinite, quantize


def round_up(n: int, m: int) -> int:
    """``n`` rounded up to a multiple of ``m`` (``n`` itself for ``m`` <= 1)."""
    return n if m <= 1 else -(-n // m) * m


def pad2(t: jax.Array, f: int, c: int) -> jax.Array:
    """A 2-D ``t`` zero-padded at the end to ``[f, c]``."""
    pf, pc = f - t.shape[0], c - t.shape[1]
    return jnp.pad(t, ((0, pf), (0, pc))) if pf or pc else t


@functools.partial(jax.tree_util.register_dataclass, data_fields=["sa"],
                   meta_fields=["cmajor"])
@dataclasses.dataclass(frozen=True)
class Operand:
    """A quantized GEMM operand, logically ``[F, C]`` (free, contraction): ``sa`` holds it
    as stored, ``[F, C]``, or (``cmajor``) as its transpose ``[C, F]``.

    Quantizing ``t.T`` along its rows gives, element for element, the transpose of
    quantizing ``t`` along its columns (the same blocks: a max is order-free), so an operand
    that a GEMM contracts along the major axis of the array it comes from (x and dy in the
    weight gradient, a ``[K, N]`` kernel in the forward GEMM) is quantized in that array's
    own layout and contracted there by ``lax.dot_general``'s dimension numbers. XLA:CPU
    writes a transposed f32 array several times slower than a copy, and a dot reads either
    layout at the same speed.
    """

    sa: ScaledArray
    cmajor: bool = False

    @property
    def shape(self) -> tuple[int, int]:
        """The logical shape [F, C]."""
        f, c = self.sa.values.shape[::-1] if self.cmajor else self.sa.values.shape
        return f, c

    @property
    def block(self) -> tuple[int, int]:
        """The logical block (free, contraction)."""
        bf, bc = self.sa.block[::-1] if self.cmajor else self.sa.block
        return bf, bc

    def scale(self) -> jax.Array:
        """The scale laid out per logical block, [F / bf, C / bc] (a small array)."""
        return self.sa.scale.T if self.cmajor else self.sa.scale

    def logical(self) -> ScaledArray:
        """The operand as a ``ScaledArray`` [F, C] (transposed if stored ``cmajor``)."""
        if not self.cmajor:
            return self.sa
        return ScaledArray(self.sa.values.T, self.sa.scale.T, self.sa.fmt, self.sa.recipe)


def _quantize(t: jax.Array, fmt: str, tile: Tile, recipe: Fp8Recipe,
              amax: jax.Array | None, cmajor: bool = False) -> ScaledArray:
    """Quantizes a 2-D [free, contraction] operand (already padded to its blocks), or
    (``cmajor``) its transpose, given as [contraction, free]."""
    scaling = scaling_of(tile, recipe, cmajor)
    if scaling is not None:
        if tile.kind != "tensor":
            return quantize(t, fmt, scaling)
        # A current recipe's amax is max |t| (mesh-reduced at most): it covers t.
        return quantize(t, fmt, scaling, amax=amax, amax_covers_x=not recipe.delayed)
    f = get_format(fmt)
    t32 = t.astype(jnp.float32)
    values = keep_nonfinite(t32, jnp.clip(t32, -f.max, f.max)).astype(f.dtype)
    return ScaledArray(values, jnp.ones((1, 1), jnp.float32), f, TensorScaling())


def quantize_operand(t: jax.Array, fmt: str, tile: Tile, recipe: Fp8Recipe,
                     amax: jax.Array | None, c_to: int, *, cmajor: bool = False) -> Operand:
    """Zero-pads ``t`` [F, C] to its free block and to ``c_to`` columns, then quantizes;
    ``cmajor``: ``t`` is given as [C, F] (the operand's transpose) and stays in that layout.

    Padding is exact: zeros never raise a block's amax, an all-zero block gets scale 1 and
    zero values, and padded rows / columns contribute zero products (sliced off after).
    """
    if cmajor:
        t = pad2(t, c_to, round_up(t.shape[1], tile.f))
    else:
        t = pad2(t, round_up(t.shape[0], tile.f), c_to)
    return Operand(_quantize(t, fmt, tile, recipe, amax, cmajor), cmajor)


def transpose_operand(op: Operand, f_to: int, c_to: int) -> Operand:
    """The transpose of a quantized operand with a transposable tile, padded to [f_to, c_to]
    (per-tensor: zero values, same scale; square blocks: zero blocks of scale 1). No data
    moves: the stored arrays are kept and the layout flag flips (see ``Operand``)."""
    sa, cmajor = op.sa, not op.cmajor
    v, s = sa.values, sa.scale
    if cmajor:  # stored [C', F'] of the new logical [F', C']
        to = (c_to, max(f_to, v.shape[1]))  # extra zero rows are sliced off with the output
    else:
        to = (max(f_to, v.shape[0]), c_to)
    if s.shape != (1, 1):
        b0, b1 = sa.block
        s = jnp.pad(s, ((0, to[0] // b0 - s.shape[0]), (0, to[1] // b1 - s.shape[1])),
                    constant_values=1)
    return Operand(ScaledArray(pad2(v, *to), s, sa.fmt, sa.recipe), cmajor)


def padded_c(c: int, *tiles: Tile) -> int:
    """A contraction of ``c`` elements padded to every tile's contraction block."""
    return round_up(c, math.lcm(*(max(t.c, 1) for t in tiles)))
