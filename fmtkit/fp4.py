"""FP4 training matmuls: NVFP4 and MXFP4 quantization, the random Hadamard transform, and FP4
recipes for ``fmtkit.fp8.dot_general``, emulated on any machine.

Formats. E2M1 (``float4_e2m1fn``): values ±{0, 0.5, 1, 1.5, 2, 3, 4, 6}, no inf or NaN (OCP
MX v1.0, section 5.3.3). Casts go through ``fmtkit.cast`` (round-to-nearest-even, bit-identical
to ml_dtypes; or stochastic rounding), which saturates to ±6 as ml_dtypes does.

NVFP4 (NVIDIA, "Pretraining Large Language Models with NVFP4", arXiv 2509.25149, appendix B;
Transformer Engine ``core_nvfp4.cuh``): E2M1 elements in blocks of 16 along the GEMM's
contraction (1x16; 16x16 for weights) with an E4M3 block scale and a per-tensor f32 scale, so
that ``x ≈ q * s_block * s_tensor``::

    amax_t  = max |x| over the tensor                (NaN counts as inf)
    s_enc   = 6 * 448 / amax_t                       (E2M1 max times E4M3 max: the largest
                                                      block then gets the block scale 448)
    s_enc   = 1 where amax_t == 0; min(s_enc, f32 max) (TE's guards)
    s_tensor = 1 / s_enc                             (stored, f32; NaN when amax_t is not finite)
    s_block = e4m3_rne(min(amax_b / 6 * s_enc, 448)) (amax_b: the block's amax; stored E4M3)
    enc_b   = min(1 / (f32(s_block) * s_tensor), f32 max)
    q       = round(x * enc_b) to E2M1, saturating at ±6  (RNE or stochastic)

A block whose scale rounds to 0 in E4M3 (amax_b < 2^-10 * amax_t * 6 / 448 roughly) stores
zeros: it underflows, as on the hardware. One deviation from TE, for NaN in, NaN out: TE sets
``s_enc = 1`` when ``amax_t`` is inf (``s_enc == 0``), which would quantize a tensor holding an
inf to finite values; here its ``s_tensor`` is NaN, so it dequantizes (and multiplies) to NaN.

MXFP4 (OCP MX v1.0 section 6.3, as ``fmtkit.MXScaling``): E2M1 elements in blocks of 32 with an
E8M0 power-of-two scale. Scale rules "floor" (the spec: ``2^(floor(log2 amax) - 2)``, 2 being
E2M1's largest exponent; values in (6, 8) saturate) and "rceil" (``2^ceil(log2(amax / 6))``,
the rounding up of the NVFP4 paper's MXFP4 runs, section 2, and of cuBLAS/TE: nothing
saturates), "ceil" and "even" (torchao).

Random Hadamard transform (arXiv 2509.25149 section 4.2, appendix C; TE ``hadamard.py``): the
16x16 Sylvester Hadamard matrix H times a random sign diagonal S, ``R = S H / 4`` (orthogonal),
applied to each 16-wide tile of the contraction dimension of both weight-gradient operands:
``(a R)(b R)ᵀ = a bᵀ`` in exact arithmetic, while outliers are spread over 16 elements before
FP4 quantization. One sign vector for every layer and the whole run (the paper's choice), drawn
from ``Fp4Recipe.rht_seed``: reproducible, and checkpointed with the recipe (a config field).

Recipe per GEMM (Y = X Wᵀ; arXiv 2509.25149 section 4, TE ``NVFP4BlockScaling``)::

    forward  y  = x · wᵀ    x 1x16 RNE, w 16x16 RNE
    dgrad    dx = dy · w    dy 1x16 SR, w the same 16x16 blocks (its transpose: forward and
                            backward see the same quantized weight)
    wgrad    dw = dyᵀ · x   both along the tokens, RHT-16 on both, dy 1x16 SR, x 1x16 RNE

Every ingredient is a field of ``Fp4Recipe``; the named variants are in ``RECIPES``.

Stochastic rounding keys. A GEMM has no step counter, so the key of each SR quantization is
derived from ``Fp4Recipe.sr_seed``, the operand's role, and a 32-bit hash of the operand's
bits: reproducible (same seed, same data: same rounding), different at every step and in every
layer (different gradients), and nothing to thread or checkpoint beyond the seed.

Emulation. XLA's CPU and pre-Blackwell GPU backends cannot take E2M1 operands into a dot, so the
emulated GEMM widens each FP4 array exactly to E4M3 (every E2M1 value is an E4M3 value) inside
the GEMM and runs ``fmtkit.fp8.scaled_matmul``: one FP8 dot per 16 (or 32) elements of the
contraction with f32 accumulation, block scales applied per block, the two tensor scales
applied to the f32 output (the Blackwell GEMM's ``alpha``). On a Blackwell GPU, NVFP4 GEMMs run
through ``jax.nn.scaled_matmul`` (cuDNN's block-scaled dot) instead.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any, ClassVar, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from fmtkit import fp8
from fmtkit.casting import cast, check_floating
from fmtkit.formats import get_format
from fmtkit.scaling import MXScaling, ScaledArray
from fmtkit.scaling import quantize as scaled_quantize

__all__ = [
    "RECIPES",
    "Fp4Array",
    "Fp4Recipe",
    "dequantize",
    "dot_general_fn",
    "get_recipe",
    "hadamard_matrix",
    "mxfp4_quantize",
    "nvfp4_quantize",
    "quantization_stats",
    "random_hadamard_transform",
    "rht_matrix",
]

E2M1 = get_format("float4_e2m1fn")
E4M3 = get_format("float8_e4m3fn")
_E2M1_MAX = 6.0  # OCP MX v1.0 table 5: largest E2M1 value
_E4M3_MAX = 448.0  # OCP FP8 (OFP8) E4M3: largest finite value
_F32_MAX = float(np.finfo(np.float32).max)
_ROUNDINGS = ("nearest", "stochastic")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Fp4Array:
    """E2M1 values with their block scales and tensor scale: ``x ≈ values * block_scale *
    tensor_scale`` (the block scale broadcast over its ``block`` of trailing dims).

    Attributes:
      values: ``float4_e2m1fn`` array, the shape of x.
      block_scale: E4M3 (NVFP4) or E8M0 (MXFP4) array of x's rank,
        ``shape[i] = x.shape[i] // block[i]``.
      tensor_scale: f32 scalar (NVFP4's second-level decode scale; 1 for MXFP4).
      block: the block shape (static).
    """

    values: jax.Array
    block_scale: jax.Array
    tensor_scale: jax.Array
    block: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))

    def dequantize(self, dtype: jax.typing.DTypeLike = jnp.float32) -> jax.Array:
        """``(values * f32(block_scale)) * tensor_scale`` in f32, cast to ``dtype``."""
        v = _blocks(self.values.astype(jnp.float32), self.block)
        s = _scale_view(self.block_scale.astype(jnp.float32), self.block)
        return ((v * s).reshape(self.values.shape) * self.tensor_scale).astype(dtype)


def dequantize(q: Fp4Array, dtype: jax.typing.DTypeLike = jnp.float32) -> jax.Array:
    """``q.dequantize(dtype)``."""
    if not isinstance(q, Fp4Array):
        raise TypeError(f"dequantize expects an Fp4Array, got {type(q).__name__}.")
    return q.dequantize(dtype)


# ---------------------------------------------------------------------------------------------
# Blocks of the trailing dims: x [..., A, B] with block (ba, bb) -> [..., A/ba, ba, B/bb, bb].


def _check_block(x: jax.Array, block: tuple[int, ...], arg: str = "block") -> tuple[int, ...]:
    block = (block,) if isinstance(block, int) else tuple(block)
    if not block or len(block) > 2 or not all(isinstance(b, int) and b > 0 for b in block):
        raise ValueError(f"{arg} must be one or two positive ints (e.g. (1, 16), (16, 16)), "
                         f"got {block!r}.")
    if x.ndim < len(block):
        raise ValueError(f"{arg}={block} has more dims than x (shape {x.shape}).")
    for i, b in enumerate(block):
        n = x.shape[x.ndim - len(block) + i]
        if n % b:
            raise ValueError(f"x.shape[{x.ndim - len(block) + i}]={n} is not divisible by "
                             f"{arg}={block}.")
    return (1,) * (x.ndim - len(block)) + block


def _blocks(x: jax.Array, block: tuple[int, ...]) -> jax.Array:
    split = []
    for n, b in zip(x.shape, block):
        split += [n // b, b]
    return x.reshape(split)


def _scale_view(s: jax.Array, block: tuple[int, ...]) -> jax.Array:
    return s.reshape([d for n in s.shape for d in (n, 1)])


def _block_amax(x: jax.Array, block: tuple[int, ...]) -> jax.Array:
    a = jnp.abs(x.astype(jnp.float32))
    a = jnp.where(jnp.isnan(a), jnp.float32(jnp.inf), a)  # XLA CPU's max drops NaN
    return jnp.max(_blocks(a, block), axis=tuple(range(1, 2 * x.ndim, 2)))


def _amax(x: jax.Array) -> jax.Array:
    a = jnp.abs(x.astype(jnp.float32))
    return jnp.max(jnp.where(jnp.isnan(a), jnp.float32(jnp.inf), a))


def _round(v: jax.Array, rounding: str, key: jax.Array | None) -> jax.Array:
    if rounding not in _ROUNDINGS:
        raise ValueError(f"rounding must be one of {_ROUNDINGS}, got {rounding!r}.")
    return cast(v, E2M1, rounding=rounding, key=key)


def nvfp4_quantize(x: jax.typing.ArrayLike, block: tuple[int, ...] = (1, 16), *,
                   rounding: Literal["nearest", "stochastic"] = "nearest",
                   key: jax.Array | None = None,
                   amax: jax.typing.ArrayLike | None = None) -> Fp4Array:
    """Quantizes ``x`` to NVFP4: E2M1 values, E4M3 block scales, an f32 tensor scale.

    The scale computation is the module docstring's (arXiv 2509.25149 appendix B, Transformer
    Engine's CUDA quantizer).

    Args:
      x: floating array; ``block`` tiles its trailing dims.
      block: (1, 16) for activations and gradients, (16, 16) for weights (the paper's 2D
        blocks, so that the transpose has the same blocks and scales).
      rounding: "nearest" (RNE) or "stochastic" (needs ``key``), applied after scaling.
      key: PRNG key for stochastic rounding.
      amax: the tensor amax to use instead of ``max |x|`` (e.g. reduced over a mesh).

    Returns:
      An ``Fp4Array``.

    Raises:
      TypeError: x not floating. ValueError: a block that does not tile x, bad rounding.

    Example:
      >>> q = nvfp4_quantize(jnp.array([[6.0 * 448, 1.0] + [0.0] * 14]))
      >>> q.tensor_scale.item(), q.block_scale.astype(jnp.float32).tolist()
      (1.0, [[448.0]])
    """
    x = check_floating(x)
    block = _check_block(x, block)
    t_amax = _amax(x) if amax is None else jnp.asarray(amax, jnp.float32)
    s_enc = jnp.float32(_E2M1_MAX * _E4M3_MAX) / t_amax
    s_enc = jnp.where((t_amax == 0) | (s_enc == 0), jnp.float32(1.0),
                      jnp.minimum(s_enc, jnp.float32(_F32_MAX)))
    s_tensor = jnp.where(jnp.isfinite(t_amax), jnp.float32(1.0) / s_enc, jnp.float32(jnp.nan))
    b_amax = _block_amax(x, block)
    s_block = jnp.minimum(b_amax * jnp.float32(1.0 / _E2M1_MAX) * s_enc, jnp.float32(_E4M3_MAX))
    s_block = s_block.astype(jnp.float8_e4m3fn)
    enc = jnp.minimum(jnp.float32(1.0) / (s_block.astype(jnp.float32) * s_tensor),
                      jnp.float32(_F32_MAX))
    v = _blocks(x.astype(jnp.float32), block) * _scale_view(enc, block)
    q = _round(v.reshape(x.shape), rounding, key)
    return Fp4Array(q, s_block, s_tensor, block)


def mxfp4_quantize(x: jax.typing.ArrayLike, block: int = 32, *,
                   scale_rounding: Literal["floor", "ceil", "even", "rceil"] = "rceil",
                   rounding: Literal["nearest", "stochastic"] = "nearest",
                   key: jax.Array | None = None) -> Fp4Array:
    """Quantizes ``x`` to MXFP4: E2M1 values in ``block`` elements along the last axis with an
    E8M0 scale (``fmtkit.MXScaling``'s rules; "floor" is OCP MX v1.0's, "rceil" the default:
    the scale is rounded up, so no element saturates, as in the NVFP4 paper's MXFP4 runs).

    Args:
      x: floating array whose last dim ``block`` divides.
      block: elements per scale (32 in the spec).
      scale_rounding: the E8M0 scale rule.
      rounding: the element rounding, "nearest" or "stochastic" (which needs ``key``).
      key: the PRNG key of stochastic rounding.

    Returns:
      An ``Fp4Array`` (``tensor_scale`` 1).

    Example:
      >>> q = mxfp4_quantize(jnp.full((1, 32), 7.0), scale_rounding="floor")
      >>> q.values.astype(jnp.float32)[0, 0].item(), q.block_scale.astype(jnp.float32).item()
      (6.0, 1.0)
    """
    x = check_floating(x)
    blk = _check_block(x, (1, block) if x.ndim > 1 else (block,))
    # The E8M0 scale is fmtkit.MXScaling's; the reciprocal is formed from its exponent bits
    # (2^-127 is an f32 subnormal, which XLA CPU flushes).
    sa = scaled_quantize(x, E2M1, MXScaling(block, scale_rounding, axis=-1))
    code = lax.bitcast_convert_type(sa.scale, jnp.uint8).astype(jnp.int32)
    inv = jnp.where(code == 0xFF, jnp.float32(jnp.nan),
                    jnp.ldexp(jnp.float32(1.0), 127 - code))
    v = _blocks(x.astype(jnp.float32), blk) * _scale_view(inv, blk)
    q = _round(v.reshape(x.shape), rounding, key)
    return Fp4Array(q, sa.scale, jnp.float32(1.0), blk)


# ---------------------------------------------------------------------------------------------
# Random Hadamard transform.


@functools.cache
def hadamard_matrix(n: int = 16) -> np.ndarray:
    """The n x n Sylvester Hadamard matrix divided by sqrt(n) (orthogonal), float64.

    Raises:
      ValueError: n not a power of two >= 2.
    """
    if not isinstance(n, int) or n < 2 or n & (n - 1):
        raise ValueError(f"n must be a power of two >= 2, got {n!r}.")
    h = np.array([[1.0]])
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h / math.sqrt(n)


@functools.cache
def rht_matrix(seed: int = 0, n: int = 16) -> np.ndarray:
    """``R = diag(s) H_n / sqrt(n)`` with a sign vector ``s`` drawn from ``seed`` (NumPy's
    PCG64, stable across platforms and releases), float64 [n, n]; ``R Rᵀ = I``."""
    return _rht_signs(seed, n)[:, None] * hadamard_matrix(n)


def _rht_signs(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).choice(np.array([-1.0, 1.0]), size=n)


def random_hadamard_transform(t: jax.typing.ArrayLike, *, seed: int = 0,
                              size: int = 16) -> jax.Array:
    """``t`` rotated by ``rht_matrix(seed, size)`` in each ``size``-wide tile of its last axis
    (computed in f32, returned in f32).

    Applied to both operands of a product along their shared (contracted) last axis, it
    cancels: ``rht(a) @ rht(b).T == a @ b.T`` up to rounding.

    Raises:
      ValueError: the last dim is not a multiple of ``size``.
    """
    t = check_floating(t, "t")
    if t.ndim == 0 or t.shape[-1] % size:
        raise ValueError(f"t's last dim ({t.shape[-1:] or 'scalar'}) must be a multiple of "
                         f"size={size}.")
    hadamard_matrix(size)  # validates size
    signs = jnp.asarray(_rht_signs(seed, size), jnp.float32)
    lead = t.shape[:-1]
    v = t.astype(jnp.float32).reshape(*lead, t.shape[-1] // size, size)
    v = v * signs.reshape((1,) * (v.ndim - 1) + (size,))
    # Fast Walsh-Hadamard transform: log2(size) butterfly stages (I ⊗ H2 ⊗ I_h for h = 1, 2,
    # 4, ...; their product is Sylvester's H), adds and subtracts, so no matmul appears in
    # the jaxpr besides the GEMMs (what TE's kernels do too), then the exact 1 / sqrt(size).
    h = 1
    while h < size:
        b = v.reshape(*lead, -1, size // (2 * h), 2, h)
        v = jnp.stack([b[..., 0, :] + b[..., 1, :], b[..., 0, :] - b[..., 1, :]], axis=-2)
        h *= 2
    return (v.reshape(t.shape) * jnp.float32(1.0 / math.sqrt(size))).astype(jnp.float32)


# ---------------------------------------------------------------------------------------------
# Recipes.


def _tile(spec: str) -> tuple[int, int]:
    """(free, contraction) block of an FP4 tile: "mxB" -> (1, B), "AxB" -> (A, B) (the
    syntax is checked by ``Fp8Recipe``)."""
    if spec.startswith("mx"):
        return 1, int(spec[2:])
    f, _, c = spec.partition("x")
    return (int(f), int(c)) if c else (0, 0)


def _free_block(spec: str) -> int:
    return _tile(spec)[0]


def _c_block(spec: str) -> int:
    return _tile(spec)[1]


@dataclasses.dataclass(frozen=True)
class Fp4Recipe(fp8.Fp8Recipe):
    """An FP4 recipe for ``fmtkit.fp8.dot_general`` (and policies): every ingredient a field.

    A subclass of ``fmtkit.fp8.Fp8Recipe`` (so rules and policies take it wherever they take
    an FP8 recipe); tiles are given for a ``[free, contraction]`` operand as there.

    Attributes:
      block_scale: "e4m3" (NVFP4: E4M3 block scales and an f32 tensor scale; tiles "1xB" or
        "BxB") or "e8m0" (MXFP4: tiles "mxB").
      x_tile, w_tile, grad_tile: NVFP4 "1x16" activations and gradients, "16x16" weights (the
        paper's 2D weight blocks; "1x16" re-quantizes the weight along each GEMM's
        contraction); MXFP4 "mx32".
      x_rounding, w_rounding, grad_rounding: "nearest" (RNE) or "stochastic" (the paper:
        gradients only; SR on activations or weights diverged at 1.2B, appendix E.3).
      rht: the random Hadamard transform on both weight-gradient operands (never on the
        forward or dgrad: no gain there, section 4.2).
      rht_size: the Hadamard size (16: the paper's and TE's; 128 gains little, E.4.2).
      rht_seed: seed of the RHT's sign vector (one vector for every layer and the run).
      sr_seed: seed of the stochastic rounding keys (see the module docstring).
    """

    name: str = "nvfp4"
    x_format: str = "float4_e2m1fn"
    w_format: str = "float4_e2m1fn"
    grad_format: str = "float4_e2m1fn"
    x_tile: str = "1x16"
    w_tile: str = "16x16"
    grad_tile: str = "1x16"
    block_scale: Literal["e4m3", "e8m0"] = "e4m3"
    x_rounding: Literal["nearest", "stochastic"] = "nearest"
    w_rounding: Literal["nearest", "stochastic"] = "nearest"
    grad_rounding: Literal["nearest", "stochastic"] = "stochastic"
    rht: bool = True
    rht_size: int = 16
    rht_seed: int = 0
    sr_seed: int = 0

    # fmtkit.fp8.dot_general runs this custom-VJP core for FP4 recipes (set below).
    gemm_core: ClassVar[Callable[..., jax.Array]]

    def __post_init__(self):
        super().__post_init__()
        for arg in ("x_format", "w_format", "grad_format"):
            if get_format(getattr(self, arg)) != E2M1:
                raise ValueError(f"{arg}={getattr(self, arg)!r}: FP4 recipes take E2M1 "
                                 "('float4_e2m1fn', 'fp4') elements.")
        if self.block_scale not in ("e4m3", "e8m0"):
            raise ValueError(f"block_scale must be 'e4m3' (NVFP4) or 'e8m0' (MXFP4), got "
                             f"{self.block_scale!r}.")
        for arg in ("x_tile", "w_tile", "grad_tile"):
            spec = getattr(self, arg)
            f, c = _tile(spec)
            ok = spec.startswith("mx") if self.block_scale == "e8m0" else (
                not spec.startswith("mx") and c > 0 and f in (1, c))
            if not ok:
                allowed = "'mxB' (e.g. 'mx32')" if self.block_scale == "e8m0" else \
                    "'1xB' or 'BxB' (e.g. '1x16', '16x16')"
                raise ValueError(f"{arg}={getattr(self, arg)!r} with block_scale="
                                 f"{self.block_scale!r}: use {allowed}.")
        for arg in ("x_rounding", "w_rounding", "grad_rounding"):
            if getattr(self, arg) not in _ROUNDINGS:
                raise ValueError(f"{arg} must be one of {_ROUNDINGS}, got "
                                 f"{getattr(self, arg)!r}.")
        if not isinstance(self.rht_size, int) or self.rht_size < 2 or (
                self.rht_size & (self.rht_size - 1)):
            raise ValueError(f"rht_size must be a power of two >= 2, got {self.rht_size!r}.")
        for arg in ("rht_seed", "sr_seed"):
            v = getattr(self, arg)
            if isinstance(v, bool) or not isinstance(v, int) or not -(2**31) <= v < 2**31:
                raise ValueError(f"{arg} must be an int32 seed, got {v!r}.")
        if self.delayed or self.accum_mantissa_bits is not None:
            raise ValueError("FP4 recipes scale just in time (delayed=False) and accumulate "
                             "in f32 (accum_mantissa_bits=None).")

    def __str__(self) -> str:
        """The name, plus every field that differs from the named recipe of that name."""
        base = RECIPES.get(self.name) or Fp4Recipe()
        diff = [f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self)
                if f.name != "name" and getattr(self, f.name) != getattr(base, f.name)]
        return f"{self.name}({', '.join(diff)})" if diff else self.name

    def scaling(self, operand: Literal["x", "w", "grad"]) -> Any:
        """Not available: NVFP4's two-level scale and FP4 stochastic rounding are no
        ``fmtkit.scaling`` recipe. Use ``nvfp4_quantize`` / ``mxfp4_quantize``.

        Raises:
          TypeError: always.
        """
        raise TypeError(f"FP4 recipe {self.name!r} has no fmtkit.scaling equivalent; quantize "
                        "with fmtkit.fp4.nvfp4_quantize / mxfp4_quantize.")


_NV = Fp4Recipe()
RECIPES: dict[str, Fp4Recipe] = {
    "nvfp4": _NV,
    "nvfp4-no-rht": dataclasses.replace(_NV, name="nvfp4-no-rht", rht=False),
    "nvfp4-no-sr": dataclasses.replace(_NV, name="nvfp4-no-sr", grad_rounding="nearest"),
    "nvfp4-no-2d": dataclasses.replace(_NV, name="nvfp4-no-2d", w_tile="1x16"),
    "mxfp4": Fp4Recipe("mxfp4", x_tile="mx32", w_tile="mx32", grad_tile="mx32",
                       block_scale="e8m0", rht_size=32),
}
"""The named FP4 recipes: NVFP4 as the paper trains it, the variants without one ingredient
each (RHT, SR, 2D weight blocks) and MXFP4 (same ingredients, 32-blocks with E8M0 scales and
a 32-wide RHT, the paper's MXFP4 setting, section 5)."""


def get_recipe(recipe: str | fp8.Fp8Recipe) -> fp8.Fp8Recipe:
    """An FP4 recipe by name (``RECIPES``), else ``fmtkit.fp8.get_recipe``'s (FP8 names); a
    recipe object is returned as is. The error lists both sets of names."""
    if isinstance(recipe, str) and recipe in RECIPES:
        return RECIPES[recipe]
    try:
        return fp8.get_recipe(recipe)
    except ValueError:
        raise ValueError(f"Unknown recipe {recipe!r}; FP8 recipes: {', '.join(fp8.RECIPES)}; "
                         f"FP4 recipes: {', '.join(RECIPES)}.") from None


# ---------------------------------------------------------------------------------------------
# The custom-VJP core on 2-D operands x [M, K], w [N, K] (K-major), y [M, N]; each operand of
# a GEMM is zero-padded to its blocks along both dims (exact: zeros never raise an amax, a
# zero block has scale 0 and zero values) and the result sliced back.


def _sr_key(recipe: Fp4Recipe, t: jax.Array, role: int) -> jax.Array:
    """A PRNG key from the seed, the operand's role and a 32-bit hash of its bits."""
    bits = lax.bitcast_convert_type(t.astype(jnp.float32), jnp.uint32).reshape(-1)
    weights = lax.iota(jnp.uint32, bits.size) * jnp.uint32(2654435761) | jnp.uint32(1)
    h = jnp.sum((bits ^ (bits >> 15)) * weights, dtype=jnp.uint32)
    # The seed's and role's key is a constant: folded at trace time, so the compiled step
    # holds one threefry loop fewer per SR quantization (same key, same stream).
    with jax.ensure_compile_time_eval():
        key = jax.random.fold_in(jax.random.key(recipe.sr_seed), role)
    return jax.random.fold_in(key, h)


def _quantize_operand(t: jax.Array, recipe: Fp4Recipe, tile_spec: str, rounding: str,
                      key_role: int) -> Fp4Array:
    """Quantizes a padded 2-D ``[free, contraction]`` operand per the recipe's tile."""
    f, c = _tile(tile_spec)
    key = _sr_key(recipe, t, key_role) if rounding == "stochastic" else None
    if recipe.block_scale == "e8m0":
        return mxfp4_quantize(t, c, scale_rounding=recipe.mx_scale_rounding,
                              rounding=rounding, key=key)
    amax = None
    if recipe.amax_reduce_axes:
        amax = _amax(t)
        for axis in recipe.amax_reduce_axes:
            amax = lax.pmax(amax, axis)
    return nvfp4_quantize(t, (f, c), rounding=rounding, key=key, amax=amax)


def _pad2(t: jax.Array, f: int, c: int) -> jax.Array:
    pf, pc = f - t.shape[0], c - t.shape[1]
    return jnp.pad(t, ((0, pf), (0, pc))) if pf or pc else t


def _up(n: int, m: int) -> int:
    return -(-n // m) * m


def _uses_scaled_matmul(recipe: Fp4Recipe, a: Fp4Array, b: Fp4Array) -> bool:
    """Whether this GEMM runs through ``jax.nn.scaled_matmul``: NVFP4 operands on a Blackwell
    GPU ("auto"), or anywhere with ``use_kernel="interpret"`` (JAX's own decomposition)."""
    if recipe.use_kernel == "never" or recipe.block_scale != "e4m3":
        return False
    return recipe.use_kernel == "interpret" or fp8.on_blackwell()


GEMM_SCOPE = "fmtkit_fp4"
"""Prefix of the named scope around every FP4 GEMM, ``fmtkit_fp4_<a block>_<b block>`` (e.g.
``fmtkit_fp4_1x16_16x16``: each operand's block shape over its [free, contraction] dims), so
a jaxpr reader (``fmtkit.policy.inspect_policy``) reports the GEMM's operands as E2M1 with
their blocks: the emulation's dot takes them widened, exactly, to E4M3."""


def _gemm_scope(a: Fp4Array, b: Fp4Array) -> str:
    """The named scope of the GEMM of ``a`` and ``b`` (``GEMM_SCOPE``)."""
    return "_".join([GEMM_SCOPE, *("x".join(map(str, t.block[-2:])) for t in (a, b))])


def _gemm(a: Fp4Array, b: Fp4Array, recipe: Fp4Recipe) -> jax.Array:
    """f32 ``a [F1, C] · b [F2, C]ᵀ`` of two FP4 operands (see the module docstring)."""
    with jax.named_scope(_gemm_scope(a, b)):
        return _gemm_body(a, b, recipe)


def _gemm_body(a: Fp4Array, b: Fp4Array, recipe: Fp4Recipe) -> jax.Array:
    alpha = a.tensor_scale * b.tensor_scale
    if _uses_scaled_matmul(recipe, a, b):
        # cuDNN's NVFP4 layout: 1x16 scales along C; a 16x16 block's scale repeats per row.
        sa = jnp.repeat(a.block_scale, a.block[0], axis=0) if a.block[0] > 1 else a.block_scale
        sb = jnp.repeat(b.block_scale, b.block[0], axis=0) if b.block[0] > 1 else b.block_scale
        out = jax.nn.scaled_matmul(a.values[None], b.values[None], sa[None], sb[None],
                                   preferred_element_type=jnp.float32)[0]
        return out * alpha
    # Emulation: E2M1 -> E4M3 is exact; XLA cannot dot E2M1 off Blackwell.
    wide = [ScaledArray(t.values.astype(jnp.float8_e4m3fn), t.block_scale.astype(jnp.float32),
                        E4M3, None) for t in (a, b)]
    return fp8.scaled_matmul(*wide) * alpha


def _transpose(q: Fp4Array, f_to: int, c_to: int) -> Fp4Array:
    """The transpose of a square-blocked operand, zero-padded (zero blocks) to [f_to, c_to]."""
    bf = q.block[1]
    v = _pad2(q.values.T, f_to, c_to)
    s = _pad2(q.block_scale.T, f_to // bf, c_to // bf)
    return Fp4Array(v, s, q.tensor_scale, q.block[::-1])


def _core_impl(recipe, x, w):
    m, k = x.shape
    n = w.shape[0]
    kp = _up(k, math.lcm(_c_block(recipe.x_tile), _c_block(recipe.w_tile)))
    xq = _quantize_operand(_pad2(x, _up(m, _free_block(recipe.x_tile)), kp), recipe,
                           recipe.x_tile, recipe.x_rounding, 0)
    wq = _quantize_operand(_pad2(w, _up(n, _free_block(recipe.w_tile)), kp), recipe,
                           recipe.w_tile, recipe.w_rounding, 1)
    return _gemm(xq, wq, recipe)[:m, :n], wq


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _core(recipe: Fp4Recipe, out_dtype, x: jax.Array, w: jax.Array, hist: jax.Array
          ) -> jax.Array:
    """``fmtkit.fp8``'s core signature; the emulated GEMMs return f32 (``out_dtype``, the
    consumer's dtype, is applied by the caller)."""
    return _core_impl(recipe, x, w)[0]


def _core_fwd(recipe, out_dtype, x, w, hist):
    y, wq = _core_impl(recipe, x, w)
    square = _free_block(recipe.w_tile) > 1
    return y, (x, w, wq if square else None, hist)


def _core_bwd(recipe, out_dtype, res, g):
    del out_dtype
    x, w, wq, hist = res
    m, k = x.shape
    n = w.shape[0]
    # dgrad: dx [M, K] = g [M, N] · w [N, K], contracting N; the weight's 2D blocks transposed.
    cw = _c_block(recipe.w_tile)
    np_ = _up(n, math.lcm(_c_block(recipe.grad_tile), cw))
    gq = _quantize_operand(_pad2(g, _up(m, _free_block(recipe.grad_tile)), np_), recipe,
                           recipe.grad_tile, recipe.grad_rounding, 2)
    if wq is not None:
        wq_n = _transpose(wq, wq.values.shape[1], np_)
    else:
        wq_n = _quantize_operand(_pad2(w.T, _up(k, _free_block(recipe.w_tile)), np_), recipe,
                                 recipe.w_tile, recipe.w_rounding, 1)
    with jax.named_scope(fp8.DGRAD_SCOPE):
        dx = _gemm(gq, wq_n, recipe)[:m, :k].astype(x.dtype)
    # wgrad: dw [N, K] = gᵀ [N, M] · x [M, K], contracting the tokens M, both rotated.
    blocks = [_c_block(recipe.grad_tile), _c_block(recipe.x_tile)]
    mp = _up(m, math.lcm(*blocks, recipe.rht_size if recipe.rht else 1))
    a = _pad2(g.T, _up(n, _free_block(recipe.grad_tile)), mp)
    b = _pad2(x.T, _up(k, _free_block(recipe.x_tile)), mp)
    if recipe.rht:
        a = random_hadamard_transform(a, seed=recipe.rht_seed, size=recipe.rht_size)
        b = random_hadamard_transform(b, seed=recipe.rht_seed, size=recipe.rht_size)
    aq = _quantize_operand(a, recipe, recipe.grad_tile, recipe.grad_rounding, 3)
    bq = _quantize_operand(b, recipe, recipe.x_tile, recipe.x_rounding, 4)
    with jax.named_scope(fp8.WGRAD_SCOPE):
        dw = _gemm(aq, bq, recipe)[:n, :k].astype(w.dtype)
    return dx, dw, jnp.zeros_like(hist)


_core.defvjp(_core_fwd, _core_bwd)
Fp4Recipe.gemm_core = _core


def dot_general_fn(recipe: str | Fp4Recipe = "nvfp4", *, name: str | None = None):
    """``fmtkit.fp8.dot_general_fn`` for an FP4 recipe (a name from ``RECIPES`` or an
    ``Fp4Recipe``): a function with ``lax.dot_general``'s signature whose forward, dgrad and
    wgrad GEMMs take FP4 operands.

    Example:
      >>> dg = dot_general_fn("nvfp4")
      >>> dg(jnp.ones((32, 48)), jnp.ones((48, 16)), (((1,), (0,)), ((), ()))).shape
      (32, 16)
    """
    return fp8.dot_general_fn(get_recipe(recipe), name=name)


def quantization_stats(t: jax.typing.ArrayLike, recipe: str | Fp4Recipe = "nvfp4",
                       operand: Literal["x", "w", "grad"] = "x") -> dict[str, jax.Array]:
    """What one GEMM operand loses to a recipe's FP4 quantization (telemetry, in-jit).

    ``t`` is laid out ``[free, contraction]`` (x: [tokens, K]; w: [N, K], a Flax kernel
    transposed; grad: [tokens, N]), zero-padded to its blocks, and quantized as the forward
    (x, w) or dgrad (grad) GEMM does (stochastic rounding with a fixed key).

    Returns:
      f32 scalars: ``sqnr_db`` (10 log10 of signal over quantization-error power),
      ``saturated_blocks`` (share of blocks with an element beyond ±6 after scaling, clipped:
      an E4M3 block scale rounded down, or MX's "floor" rule), ``underflow_blocks`` (share of
      nonzero blocks that dequantize to all zeros: an E4M3 scale of 0, or every element
      under half of E2M1's smallest step), ``zero_fraction`` (share of nonzero elements
      quantized to 0).
    """
    recipe = get_recipe(recipe)
    if not isinstance(recipe, Fp4Recipe):
        raise TypeError(f"quantization_stats needs an FP4 recipe, got {recipe.name!r}.")
    if operand not in ("x", "w", "grad"):
        raise ValueError(f"operand must be 'x', 'w' or 'grad', got {operand!r}.")
    t = check_floating(t, "t").astype(jnp.float32)
    if t.ndim != 2:
        raise ValueError(f"t must be 2-D [free, contraction], got shape {t.shape}.")
    spec, rounding = getattr(recipe, f"{operand}_tile"), getattr(recipe, f"{operand}_rounding")
    f, c = _tile(spec)
    t = _pad2(t, _up(t.shape[0], f), _up(t.shape[1], c))
    role = {"x": 0, "w": 1, "grad": 2}[operand]
    q = _quantize_operand(t, recipe, spec, rounding, role)
    deq = q.dequantize()
    dec = q.block_scale.astype(jnp.float32) * q.tensor_scale  # decode scale per block
    a = _blocks(jnp.abs(t), q.block)
    axes = tuple(range(1, 2 * t.ndim, 2))
    sat = jnp.any(a > jnp.float32(_E2M1_MAX) * _scale_view(dec, q.block), axis=axes)
    nonzero = jnp.any(a > 0, axis=axes)
    dead = nonzero & ~jnp.any(_blocks(deq, q.block) != 0, axis=axes)
    err = jnp.sum(jnp.square(deq - t))
    n_nz = jnp.maximum(jnp.sum(t != 0), 1)
    return {
        "sqnr_db": 10 * jnp.log10(jnp.sum(jnp.square(t)) / err),
        "saturated_blocks": jnp.mean(sat.astype(jnp.float32)),
        "underflow_blocks": jnp.sum(dead) / jnp.maximum(jnp.sum(nonzero), 1),
        "zero_fraction": jnp.sum((t != 0) & (deq == 0)) / n_nz,
    }
