"""FP8 training matmuls: a scaled ``dot_general`` with a custom VJP and named recipes.

Each of the three GEMMs of a linear layer receives real FP8 operands (FP8 arrays into
``lax.dot_general`` with ``preferred_element_type=f32``), each operand quantized along the
axis that GEMM contracts over:

    forward   y  = x  · w      contracts K        x tiles along K, w tiles along K
    dgrad     dx = dy · wᵀ     contracts N        dy tiles along N, w tiles along N
    wgrad     dw = xᵀ · dy     contracts tokens   x and dy tiles along the tokens

A GEMM of quantized ``a [F1, C]`` and ``b [F2, C]`` (both contraction-minor, DeepSeek's
K-major layout) with scales per tile is computed with the scales applied per block of the
contraction (DeepSeek-V3's promotion into f32):

    g = the smaller contraction tile of a and b
    out[i, j] = sum_kb  sa[i, kb] * sb[j, kb] * (a_q[i, kb*g:(kb+1)*g] · b_q[j, kb*g:(kb+1)*g])

with each partial product an FP8 dot accumulated in f32. When both scales are constant along
the contraction (per-tensor, per-row) this is one FP8 dot followed by the outer product of
the scales. When both are powers of two (MX, ``power_of_two``) and the GEMM runs off a GPU,
the scales are folded into the operands (exact) and one dot sums the same products
(``_folds_scales``). Off GPUs every dot reads its FP8 operands widened exactly to bf16
(XLA:CPU would convert them to f32 and run its slower f32 GEMM: ``_emulated_dot``), and
per-block partials of 128-wide (or wider) blocks are one 2-D dot per block in a ``lax.scan``
(``_block_dots``); on a GPU the operands always enter the dot as FP8.

Recipes (``RECIPES``; every field overridable with ``dataclasses.replace``):

    current    per tensor, just in time; E4M3 x/w, E5M2 gradients (TE "HYBRID")
    delayed    per tensor from an amax history (TE / Flax defaults: 1024, "max", margin 0),
               first step bootstrapped from the current amax; state threaded explicitly
    rowwise    one scale per row of each operand along the contraction (x rows, w columns)
    blockwise  DeepSeek-V3: 1x128 activations and gradients, 128x128 weights, E4M3 everywhere
    mxfp8      OCP MX: 1x32 tiles along the contraction with E8M0 power-of-two scales, E4M3
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from fmtkit.casting import check_floating
from fmtkit.formats import get_format
from fmtkit.scaling import (
    AxisScaling,
    BlockScaling,
    DelayedScaling,
    DelayedScalingState,
    MXScaling,
    Recipe,
    ScaledArray,
    TensorScaling,
    delayed_amax_of,
    dequantize,
    keep_nonfinite,
    quantize,
    record_amax,
)

__all__ = [
    "PARTIALS_BUDGET_BYTES",
    "RECIPES",
    "FP8Recipe",
    "Fp8DotState",
    "Fp8Recipe",
    "GemmBackend",
    "combine_observations",
    "dot_general",
    "dot_general_fn",
    "gemm_backends",
    "get_recipe",
    "init_state",
    "limited_precision_matmul",
    "register_gemm_backend",
    "scaled_matmul",
    "update_state",
]

_TILE_RE = re.compile(r"^(tensor|row|none|mx(\d+)|(\d+)x(\d+))$")


def _parse_tile(spec: str, arg: str) -> tuple[str, tuple[int, int] | int | None]:
    m = _TILE_RE.match(spec) if isinstance(spec, str) else None
    if not m:
        raise ValueError(
            f"{arg}={spec!r} is not a tiling; use 'tensor', 'row', 'none', 'mxN' (e.g. "
            f"'mx32') or 'AxB' (e.g. '1x128', '128x128').")
    if m.group(2):
        return "mx", int(m.group(2))
    if m.group(3):
        return "block", (int(m.group(3)), int(m.group(4)))
    return spec, None


def _check_fields(recipe: Any) -> None:
    """Types and choices of an ``Fp8Recipe``'s plain fields (the formats, tiles and
    delayed-scaling fields are checked where they are parsed)."""
    if not isinstance(recipe.name, str):
        raise TypeError(f"name must be a string, got {recipe.name!r}.")
    for arg in ("delayed", "power_of_two"):
        if not isinstance(getattr(recipe, arg), bool):
            raise TypeError(f"{arg} must be True or False, got {getattr(recipe, arg)!r}.")
    for arg in ("accum_mantissa_bits", "promote_every"):
        v = getattr(recipe, arg)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool)):
            raise TypeError(f"{arg} must be an int or None, got {v!r}.")
    rules = ("floor", "ceil", "even", "rceil")
    if recipe.mx_scale_rounding not in rules:
        raise ValueError(f"mx_scale_rounding must be one of {rules}, got "
                         f"{recipe.mx_scale_rounding!r}.")


@dataclasses.dataclass(frozen=True)
class Fp8Recipe:
    """How the three GEMMs of a scaled ``dot_general`` quantize their operands.

    Spelled like ``Fp8DotState`` and Flax's ``Fp8DotGeneralOp``; ``FP8Recipe`` is the same
    class under its earlier name.

    Tilings are given for an operand laid out as ``[free, contraction]``: "1x128" is one
    scale per row and 128 contraction elements; "128x128" a square block; "row" one scale
    per row over the whole contraction; "tensor" one scale; "mx32" OCP MX blocks of 32 with
    E8M0 scales; "none" a plain cast (no scale).

    Attributes:
      name: the recipe's name (for tables and CLIs).
      x_format, w_format, grad_format: element formats of activations, weights, gradients.
      x_tile, w_tile, grad_tile: tilings (the same tiling is applied along whichever axis a
        GEMM contracts, so x is re-quantized 128x1 for the weight gradient under "1x128").
      delayed: per-tensor scales from an amax history (needs an ``Fp8DotState``).
      history, amax_algo, margin: delayed-scaling parameters (Transformer Engine's defaults).
      power_of_two: round scales up to powers of two (DeepGEMM's ``ceil_to_ue8m0``).
      mx_scale_rounding: the MX scale rule (see ``fmtkit.MXScaling``); "rceil" is what
        cuBLAS and Transformer Engine use (no element overflow).
      accum_mantissa_bits: if set, emulate an accumulator with this many mantissa bits
        (Hopper FP8 tensor cores keep about 14 bits, DeepSeek-V3 section 3.3.2), promoting
        into f32 every ``promote_every`` elements of the contraction (N_C = 128).
      use_kernel: "auto" runs a registered GEMM backend (``register_gemm_backend``) where
        one applies and its hardware is present: the Pallas blockwise kernel
        (``pallas_kernels``; E4M3, 1x128 x 128x128 or 1x128 x 1x128: all three GEMMs of
        "blockwise") on a Hopper GPU, JAX's native block-scaled dot (``jax.nn.scaled_matmul``,
        MXFP8: all three GEMMs of "mxfp8") on a Blackwell GPU; elsewhere the jitted pure-JAX
        path (``scaled_matmul``, same semantics). "never" always the pure-JAX path;
        "interpret" the backends that apply, off their hardware (the Pallas kernel in
        GPU-interpret mode, the block-scaled dot in JAX's decomposition), for CPU tests.
      amax_reduce_axes: mesh axis names to take per-tensor amaxes over (``lax.pmax``) when
        the dot runs inside ``shard_map`` on a shard of the tensor, so every device uses the
        global scale. Under ``jax.jit`` with shardings leave it empty: reductions there are
        already global. Block scales need no reduction (they shard with their blocks).
    """

    name: str = "custom"
    x_format: str = "e4m3"
    w_format: str = "e4m3"
    grad_format: str = "e5m2"
    x_tile: str = "tensor"
    w_tile: str = "tensor"
    grad_tile: str = "tensor"
    delayed: bool = False
    history: int = 1024
    amax_algo: Literal["max", "most_recent"] = "max"
    margin: int = 0
    power_of_two: bool = False
    mx_scale_rounding: Literal["floor", "ceil", "even", "rceil"] = "rceil"
    accum_mantissa_bits: int | None = None
    promote_every: int | None = 128
    use_kernel: Literal["auto", "never", "interpret"] = "auto"
    amax_reduce_axes: tuple[str, ...] = ()

    def __post_init__(self):
        _check_fields(self)
        for arg in ("x_format", "w_format", "grad_format"):
            fmt = get_format(getattr(self, arg))
            if fmt.bits > 8:
                raise ValueError(f"{arg}={getattr(self, arg)!r} is not an FP8/FP6/FP4 format; "
                                 "use a Policy for bf16/fp16 compute.")
        tiles = {a: _parse_tile(getattr(self, a), a) for a in ("x_tile", "w_tile", "grad_tile")}
        if self.delayed and any(k != "tensor" for k, _ in tiles.values()):
            raise ValueError("delayed=True needs per-tensor tiles ('tensor') for x, w and grad.")
        if tiles["grad_tile"][0] == "none" and get_format(self.grad_format).max < 57344.0:
            raise ValueError(
                f"grad_format={self.grad_format!r} has max "
                f"{get_format(self.grad_format).max:g}: unscaled gradients need E5M2's range "
                "(57344) or a scaled grad_tile.")
        DelayedScaling(self.history, self.amax_algo, self.margin)  # validates those fields
        if self.accum_mantissa_bits is not None and not 1 <= self.accum_mantissa_bits <= 23:
            raise ValueError(
                f"accum_mantissa_bits must be in [1, 23], got {self.accum_mantissa_bits}.")
        if self.promote_every is not None and self.promote_every <= 0:
            raise ValueError(f"promote_every must be positive or None, got {self.promote_every}.")
        if self.use_kernel not in ("auto", "never", "interpret"):
            raise ValueError("use_kernel must be 'auto', 'never' or 'interpret', got "
                             f"{self.use_kernel!r}.")
        if not isinstance(self.amax_reduce_axes, tuple) or not all(
                isinstance(a, str) for a in self.amax_reduce_axes):
            raise TypeError("amax_reduce_axes must be a tuple of mesh axis names, got "
                            f"{self.amax_reduce_axes!r}.")

    def scaling(self, operand: Literal["x", "w", "grad"]) -> Recipe | None:
        """The ``fmtkit.scaling`` recipe that quantizes ``operand`` ("x", "w" or "grad"),
        laid out ``[free, contraction]``: ``qdq(t, fmt, recipe.scaling("x"))`` is what the
        forward GEMM reads of a 2-D activation ``t`` (whose last dimension divides into the
        tiles). None for "none" (a plain saturating cast).

        Raises:
          ValueError: ``operand`` not one of "x", "w", "grad".
        """
        if operand not in ("x", "w", "grad"):
            raise ValueError(f"operand must be 'x', 'w' or 'grad', got {operand!r}.")
        return _scaling(_tile(getattr(self, f"{operand}_tile")), self)

    def __str__(self) -> str:
        """The name, plus every field that differs from the named recipe (or, for a custom
        recipe, from ``Fp8Recipe()``): ``blockwise(margin=1)``."""
        base = RECIPES.get(self.name) or Fp8Recipe()
        diff = [f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self)
                if f.name != "name" and getattr(self, f.name) != getattr(base, f.name)]
        return f"{self.name}({', '.join(diff)})" if diff else self.name


FP8Recipe = Fp8Recipe
"""The earlier spelling of ``Fp8Recipe`` (the same class), kept for existing code."""


RECIPES: dict[str, Fp8Recipe] = {
    "current": Fp8Recipe("current"),
    "delayed": Fp8Recipe("delayed", delayed=True),
    "rowwise": Fp8Recipe("rowwise", x_tile="row", w_tile="row", grad_tile="row"),
    "blockwise": Fp8Recipe("blockwise", grad_format="e4m3", x_tile="1x128",
                           w_tile="128x128", grad_tile="1x128"),
    "mxfp8": Fp8Recipe("mxfp8", grad_format="e4m3", x_tile="mx32", w_tile="mx32",
                       grad_tile="mx32"),
}
"""The named recipes (see the module docstring)."""


def get_recipe(recipe: str | Fp8Recipe) -> Fp8Recipe:
    """Returns the recipe for a name (or the recipe itself); the error lists the names."""
    if isinstance(recipe, Fp8Recipe):
        return recipe
    if isinstance(recipe, str) and recipe in RECIPES:
        return RECIPES[recipe]
    if not isinstance(recipe, str):
        raise TypeError(f"recipe must be a name from fmtkit.fp8.RECIPES ({', '.join(RECIPES)}) "
                        f"or an Fp8Recipe, got {type(recipe).__name__}.")
    raise ValueError(f"Unknown FP8 recipe {recipe!r}; valid names: {', '.join(RECIPES)}.")


# ---------------------------------------------------------------------------------------------
# Delayed-scaling state: one amax history per operand role (x, w, grad) of one dot.

Fp8DotState = DelayedScalingState
"""Delayed-scaling state of one scaled dot: ``fmtkit.DelayedScalingState`` (the one state
type of every delayed recipe) with ``amax_history`` f32[3, history] and ``count`` None.

Rows are x, w, grad; column 0 is the newest entry. While a row is all zeros (before the first
step) the current amax is used instead (``fmtkit.scaling.delayed_amax``, the bootstrap that
Flax's recipe lacks). ``count`` stays None so that ``jax.grad`` can take the whole state.

The gradient amax is only known in the backward pass, so the dot reports all three observed
amaxes as the *cotangent* of ``amax_history`` (column 0; zeros elsewhere): differentiate the
loss with respect to the state too and pass that "gradient" to ``update_state``. Never hand
it to an optimizer. A stack of L scanned layers keeps ``[L, 3, history]`` (one history per
layer); each layer's dot sees its own ``[3, history]`` slice.
"""


def init_state(recipe: str | Fp8Recipe = "delayed") -> Fp8DotState:
    """A fresh (empty-history) state for one dot: ``amax_history`` f32[3, recipe.history]."""
    recipe = get_recipe(recipe)
    return Fp8DotState(jnp.zeros((3, recipe.history), jnp.float32))


def combine_observations(a: Any, b: Any) -> Any:
    """Combines two micro-batches' observed-amax trees with ``max`` (gradient accumulation)."""
    return jax.tree.map(jnp.maximum, a, b)


def _describe(tree: Any) -> str:
    """A short description of a pytree: its structure with each leaf as dtype[shape]."""
    def leaf(x):
        return f"{jnp.result_type(x).name}{list(jnp.shape(x))}" if hasattr(x, "shape") else (
            type(x).__name__)
    text = str(jax.tree.unflatten(jax.tree.structure(tree),
                                  [leaf(x) for x in jax.tree.leaves(tree)]))
    return text if len(text) <= 300 else text[:300] + "..."


def update_state(state: Any, observed: Any) -> Any:
    """Records observed amaxes into every amax history of a tree (one step).

    Args:
      state: a pytree of amax histories: ``Fp8DotState`` nodes, or a Flax ``"fp8_state"``
        collection; every leaf f32[..., 3, history] (``[3, H]`` for one dot, ``[L, 3, H]``
        for a scanned stack of L layers).
      observed: the gradient of the loss with respect to ``state`` (same structure): each
        dot's observed x / w / grad amaxes sit in column 0 of its history. Combine
        micro-batches with ``combine_observations`` (max) before calling this once per step.

    Returns:
      The state with each history rolled by one along its last axis and the observations
      recorded (``fmtkit.scaling.record_amax``, the rule ``DelayedScaling.update`` uses); a
      dot (per layer, for a stack) whose three observations are not all finite keeps its
      history unchanged.

    Raises:
      ValueError: a leaf that is not [..., 3, history], shapes of state and observed differ,
        or ``observed`` is not a tree of the same structure as ``state``.
    """
    s_def, o_def = jax.tree.structure(state), jax.tree.structure(observed)
    if s_def != o_def:
        raise ValueError(
            "update_state(state, observed): observed must be a tree of the same structure as "
            "state, the gradient of the loss with respect to the state (e.g. "
            "jax.grad(loss, argnums=(0, 1))(params, state)[1], or the 'fp8_state' entry of "
            "linen's gradients), not a raw array or another tree. state is "
            f"{_describe(state)}; observed is {_describe(observed)}.")

    def upd(hist, obs):
        if hist is None:
            return None
        if hist.ndim < 2 or hist.shape[-2] != 3 or obs.shape != hist.shape:
            raise ValueError(
                f"update_state: every leaf must be an amax history f32[..., 3, history] with "
                f"its observation of the same shape; got {hist.shape} and {obs.shape}.")
        return record_amax(hist, obs[..., 0], group_ndim=1)

    return jax.tree.map(upd, state, observed, is_leaf=lambda t: t is None)


# ---------------------------------------------------------------------------------------------
# GEMM backends: kernels that register themselves (``pallas_kernels`` does on import).


class GemmBackend(NamedTuple):
    """A GEMM kernel for quantized operands (see ``register_gemm_backend``)."""

    name: str
    fn: Callable[..., jax.Array]
    applies: Callable[[ScaledArray, ScaledArray], bool]
    available: Callable[[], bool]


_GEMM_BACKENDS: dict[str, GemmBackend] = {}
_ENTRY_POINT_GROUP = "fmtkit.gemm_backends"
_entry_points_loaded = False


def register_gemm_backend(name: str, fn: Callable[..., jax.Array], *,
                          applies: Callable[[ScaledArray, ScaledArray], bool],
                          available: Callable[[], bool]) -> None:
    """Registers a GEMM kernel for ``Fp8Recipe.use_kernel`` "auto" / "interpret".

    Args:
      name: the backend's name (registering a name again replaces it).
      fn: ``fn(a_values, a_scale, b_values, b_scale, *, impl, out_dtype) -> [F1, F2]``,
        the product ``a [F1, C] · b [F2, C]ᵀ`` with the scales applied per block of C,
        exactly ``scaled_matmul``'s semantics, accumulated in f32 and rounded once to
        ``out_dtype`` (float32, or bfloat16 where the GEMM's consumer is bf16: the forward
        and data-gradient GEMMs of a bf16 model; a kernel that writes bf16 moves half the
        output bytes); ``impl`` is "kernel" or "interpret".
      applies: whether the kernel takes these two (padded) ``ScaledArray`` operands.
      available: whether the compiled kernel runs here (e.g. on a Hopper GPU); evaluated at
        trace time, so an abstract mesh's device counts.

    ``fmtkit`` never imports a kernel package by name: ``pallas_kernels`` calls this when it
    is imported, and "auto" also loads the packages that declare the entry-point group
    ``fmtkit.gemm_backends`` (this repository's ``pyproject.toml`` declares
    ``pallas_kernels``), so on a Hopper GPU "auto" finds the kernel without an import.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty string, got {name!r}.")
    for arg, f in (("fn", fn), ("applies", applies), ("available", available)):
        if not callable(f):
            raise TypeError(f"{arg} must be callable, got {f!r}.")
    _GEMM_BACKENDS[name] = GemmBackend(name, fn, applies, available)


def gemm_backends() -> dict[str, GemmBackend]:
    """The registered GEMM backends, after loading the ``fmtkit.gemm_backends`` entry points."""
    global _entry_points_loaded
    if not _entry_points_loaded:
        _entry_points_loaded = True
        import importlib.metadata

        for ep in importlib.metadata.entry_points(group=_ENTRY_POINT_GROUP):
            try:
                ep.load()
            except ImportError:  # an optional kernel package whose dependencies are missing
                continue
    return dict(_GEMM_BACKENDS)


# ---------------------------------------------------------------------------------------------
# Quantizing a [free, contraction] operand and the blockwise-promoted GEMM.


class _Tile(NamedTuple):
    kind: str  # "tensor", "row", "none", "mx", "block"
    f: int  # block along the free dim (1 for per-row tiles and MX; 0: whole dim)
    c: int  # block along the contraction (0: the whole dim)
    arg: Any

    @property
    def transposable(self) -> bool:
        """Quantizing t.T gives the transpose of quantizing t (same blocks, same scales)."""
        return self.kind in ("tensor", "none") or (self.kind == "block" and self.f == self.c)


@functools.cache
def _tile(spec: str) -> _Tile:
    kind, arg = _parse_tile(spec, "tile")
    if kind == "mx":
        return _Tile(kind, 1, arg, arg)
    if kind == "block":
        return _Tile(kind, arg[0], arg[1], arg)
    if kind == "row":
        return _Tile(kind, 1, 0, None)
    return _Tile(kind, 0, 0, None)


def _round_up(n: int, m: int) -> int:
    return n if m <= 1 else -(-n // m) * m


def _pad2(t: jax.Array, f: int, c: int) -> jax.Array:
    pf, pc = f - t.shape[0], c - t.shape[1]
    return jnp.pad(t, ((0, pf), (0, pc))) if pf or pc else t


def _scaling(tile: _Tile, recipe: Fp8Recipe, cmajor: bool = False) -> Recipe | None:
    """The scaling recipe of a tile of a [free, contraction] operand (None: no scale), or,
    ``cmajor``, of the same operand stored as its transpose [contraction, free]."""
    if tile.kind == "tensor":
        return TensorScaling(recipe.power_of_two, recipe.margin)
    if tile.kind == "row":
        return AxisScaling(0 if cmajor else -1, recipe.power_of_two, recipe.margin)
    if tile.kind == "mx":
        return MXScaling(tile.arg, recipe.mx_scale_rounding, axis=0 if cmajor else -1)
    if tile.kind == "block":
        return BlockScaling(tile.arg[::-1] if cmajor else tile.arg, recipe.power_of_two,
                            recipe.margin)
    return None


@functools.partial(jax.tree_util.register_dataclass, data_fields=["sa"],
                   meta_fields=["cmajor"])
@dataclasses.dataclass(frozen=True)
class _Operand:
    """A quantized GEMM operand, logically ``[F, C]`` (free, contraction): ``sa`` holds it
    as stored, ``[F, C]``, or (``cmajor``) as its transpose ``[C, F]``.

    Quantizing ``t.T`` along its rows gives, element for element, the transpose of
    quantizing ``t`` along its columns (the same blocks: a max is order-free), so an operand
    that a GEMM contracts along the major axis of the array it comes from (x and dy in the
    weight gradient, a ``[K, N]`` kernel in the forward GEMM) is quantized in that array's
    own layout and contracted there by ``lax.dot_general``'s dimension numbers. XLA:CPU
    writes a transposed f32 array several times slower than a copy (a 1024 x 1024
    transpose-and-quantize took 6.5 ms, the same quantization in place 2 ms), and a dot reads
    either layout at the same speed.
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


def _quantize(t: jax.Array, fmt: str, tile: _Tile, recipe: Fp8Recipe,
              amax: jax.Array | None, cmajor: bool = False) -> ScaledArray:
    """Quantizes a 2-D [free, contraction] operand (already padded to its blocks), or
    (``cmajor``) its transpose, given as [contraction, free]."""
    scaling = _scaling(tile, recipe, cmajor)
    if scaling is not None:
        if tile.kind != "tensor":
            return quantize(t, fmt, scaling)
        # A current recipe's amax is max |t| (mesh-reduced at most): it covers t.
        return quantize(t, fmt, scaling, amax=amax, amax_covers_x=not recipe.delayed)
    f = get_format(fmt)
    t32 = t.astype(jnp.float32)
    values = keep_nonfinite(t32, jnp.clip(t32, -f.max, f.max)).astype(f.dtype)
    return ScaledArray(values, jnp.ones((1, 1), jnp.float32), f, TensorScaling())


def _operand(t: jax.Array, fmt: str, tile: _Tile, recipe: Fp8Recipe, amax: jax.Array | None,
             c_to: int, *, cmajor: bool = False) -> _Operand:
    """Zero-pads ``t`` [F, C] to its free block and to ``c_to`` columns, then quantizes;
    ``cmajor``: ``t`` is given as [C, F] (the operand's transpose) and stays in that layout.

    Padding is exact: zeros never raise a block's amax, an all-zero block gets scale 1 and
    zero values, and padded rows / columns contribute zero products (sliced off after).
    """
    if cmajor:
        t = _pad2(t, c_to, _round_up(t.shape[1], tile.f))
    else:
        t = _pad2(t, _round_up(t.shape[0], tile.f), c_to)
    return _Operand(_quantize(t, fmt, tile, recipe, amax, cmajor), cmajor)


def _transpose(op: _Operand, f_to: int, c_to: int) -> _Operand:
    """The transpose of a quantized operand with a transposable tile, padded to [f_to, c_to]
    (per-tensor: zero values, same scale; square blocks: zero blocks of scale 1). No data
    moves: the stored arrays are kept and the layout flag flips (see ``_Operand``)."""
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
    return _Operand(ScaledArray(_pad2(v, *to), s, sa.fmt, sa.recipe), cmajor)


def _expand_scale(sa: ScaledArray, g: int) -> jax.Array:
    """Scale as f32 [F, C / g]: repeated along the free dim and over g-blocks of C."""
    s = sa.scale.astype(jnp.float32)
    f, c = sa.values.shape
    bf, bc = sa.block
    if bf > 1:
        s = jnp.repeat(s, bf, axis=0)
    if bc > g:
        s = jnp.repeat(s, bc // g, axis=1)
    return jnp.broadcast_to(s, (f, c // g))


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


_NT = (((1,), (1,)), ((), ()))  # a [F1, C] · b [F2, C]ᵀ


def scaled_matmul(a: ScaledArray, b: ScaledArray, recipe: Fp8Recipe | None = None
                  ) -> jax.Array:
    """f32 ``a [F1, C] · b [F2, C]ᵀ`` of two quantized operands, scales applied per C-block.

    With ``g`` the smaller contraction block of the two, each of the ``C / g`` partial
    products is an FP8 dot with f32 output, scaled by its blocks' scales and added into one
    f32 accumulator, blocks in order. Off GPUs, with blocks of 128 or more, each step of a
    ``lax.scan`` over the blocks is one 2-D dot (``_block_dots``). Otherwise, only when all
    ``[C/g, F1, F2]`` partials fit in ``PARTIALS_BUDGET_BYTES`` are they one batched dot; a
    larger GEMM accumulates one block per ``lax.scan`` step, so its temporaries are the
    accumulator and one partial product.
    When both scales are constant along C (per tensor, per row) it is one FP8 dot and an
    outer product of scales. When both are powers of two (MX's E8M0, ``power_of_two``) and
    the GEMM runs off a GPU, the scales are folded into the operands and one f32 dot sums
    the same exact products (``_folds_scales``: equal up to the f32 summation order).

    Raises:
      ValueError: mismatched contraction sizes.
    """
    return _scaled_matmul(a, b, recipe, transposed=False)


def _scaled_matmul(a: ScaledArray | _Operand, b: ScaledArray | _Operand,
                   recipe: Fp8Recipe | None, *, transposed: bool) -> jax.Array:
    """``scaled_matmul`` of operands stored either way (``_Operand``); ``transposed``: its
    transpose [F2, F1], bit for bit. Where both scales are constant along C it is computed
    in that layout (the product ``b · aᵀ`` holds the same sums, and the scales are applied in
    the same order, a's first): a weight gradient wanted as [K, N] for a [K, N] kernel is
    then written once, not transposed and copied after."""
    a, b = (t if isinstance(t, _Operand) else _Operand(t) for t in (a, b))
    fa, c = a.shape
    fb, cb = b.shape
    if c != cb:
        raise ValueError(f"contraction sizes differ: a has {c}, b has {cb}.")
    g = min(a.block[1], b.block[1])
    nb = c // g
    acc_bits = recipe.accum_mantissa_bits if recipe is not None else None
    if acc_bits is not None:
        la, lb = a.logical(), b.logical()
        sa, sb = _expand_scale(la, g), _expand_scale(lb, g)
        if recipe.promote_every is not None and recipe.promote_every % g and g % (
                recipe.promote_every):
            raise ValueError(f"promote_every={recipe.promote_every} must divide or be a "
                             f"multiple of the scale block {g}.")
        # Emulation: dequantize per element (exact products), accumulate in the limited
        # register; scales are folded into the operands, equivalent up to f32 round-off.
        av = la.values.astype(jnp.float32) * jnp.repeat(sa, g, axis=1)
        bv = lb.values.astype(jnp.float32) * jnp.repeat(sb, g, axis=1)
        out = limited_precision_matmul(av, bv, mantissa_bits=acc_bits,
                                       promote_every=recipe.promote_every)
        return out.T if transposed else out
    ca, cb_ = int(not a.cmajor), int(not b.cmajor)  # the stored axis each one contracts
    if nb > 1 and _folds_scales(a.sa, b.sa):
        # Power-of-two scales: dequantize (exact, in bf16) and run one dot over all of C,
        # accumulated in f32, in a named scope that tells a jaxpr reader the operands'
        # formats (WIDENED_SCOPE).
        with jax.named_scope(_scope(a, b)):
            av, bv = dequantize(a.sa, _WIDE_DTYPE), dequantize(b.sa, _WIDE_DTYPE)
            if transposed:
                return lax.dot_general(bv, av, (((cb_,), (ca,)), ((), ())),
                                       preferred_element_type=jnp.float32)
            return lax.dot_general(av, bv, (((ca,), (cb_,)), ((), ())),
                                   preferred_element_type=jnp.float32)
    if nb == 1:
        sa, sb = _row_scales(a), _row_scales(b)
        if transposed:
            out_t = _emulated_dot(b, a, b.sa.values, a.sa.values, (((cb_,), (ca,)), ((), ())))
            return out_t * sa.T * sb
        out = _emulated_dot(a, b, a.sa.values, b.sa.values, (((ca,), (cb_,)), ((), ())))
        # (out * sa) * sb, in that order: bit-identical to the earlier releases.
        return out * sa * sb.T
    # Per-block partial products (DeepSeek-V3's promotion into f32), scaled per block and
    # summed in f32. Off GPUs, blocks of at least _MIN_SCAN_BLOCK: one 2-D dot per block in a
    # lax.scan (_block_dots). Otherwise, when all partials fit in PARTIALS_BUDGET_BYTES: one
    # batched FP8 dot [nb, F1, F2] and a sum; else one block per step of a lax.scan into one
    # f32 accumulator (temporaries: the accumulator and one partial).
    sa = _rows(_block_scale(a, g), fa)  # [F1, nb]
    sb = _rows(_block_scale(b, g), fb)  # [F2, nb]
    if (_SCAN_BLOCK_DOTS and g >= _MIN_SCAN_BLOCK and _widens(a.sa.values)
            and _widens(b.sa.values)):
        return _block_dots(a, b, sa, sb, g, transposed)
    group = nb if 4 * nb * fa * fb <= PARTIALS_BUDGET_BYTES else 1

    def split(t: _Operand) -> tuple[jax.Array, int]:
        """Stored values split into [..., nb / group, group, g, ...] and the axis of
        nb / group ([F, nb/group, group, g], or [nb/group, group, g, F] if cmajor)."""
        f = t.shape[0]
        if t.cmajor:
            return t.sa.values.reshape(nb // group, group, g, f), 0
        return t.sa.values.reshape(f, nb // group, group, g), 1

    (av, ia), (bv, ib) = split(a), split(b)

    da = (1, 0) if a.cmajor else (2, 1)  # (contracting, batch) axis of a block of a
    db = (1, 0) if b.cmajor else (2, 1)

    def chunk(i):
        pa = lax.dynamic_index_in_dim(av, i, axis=ia, keepdims=False)  # [F1, group, g]
        pb = lax.dynamic_index_in_dim(bv, i, axis=ib, keepdims=False)  # (or [group, g, F])
        ca_ = lax.dynamic_slice_in_dim(sa, i * group, group, axis=1).T  # [group, F1]
        cb2 = lax.dynamic_slice_in_dim(sb, i * group, group, axis=1).T
        if transposed:  # the same products, scaled in the same order, laid out [F2, F1]
            parts = _emulated_dot(b, a, pb, pa, (((db[0],), (da[0],)), ((db[1],), (da[1],)))
                             )  # [group, F2, F1]
            return jnp.sum(parts * ca_[:, None, :] * cb2[:, :, None], axis=0)
        parts = _emulated_dot(a, b, pa, pb, (((da[0],), (db[0],)), ((da[1],), (db[1],)))
                         )  # [group, F1, F2]
        return jnp.sum(parts * ca_[:, :, None] * cb2[:, None, :], axis=0)

    if group == nb:
        return chunk(0)
    acc, _ = lax.scan(lambda acc, i: (acc + chunk(i), None),
                      jnp.zeros((fb, fa) if transposed else (fa, fb), jnp.float32),
                      jnp.arange(nb // group))
    return acc


def _block_dots(a: _Operand, b: _Operand, sa: jax.Array, sb: jax.Array, g: int,
                transposed: bool) -> jax.Array:
    """``_scaled_matmul``'s per-block form off GPUs: a ``lax.scan`` over the C / g blocks
    whose step is one 2-D dot of block i of both operands (stored values widened exactly to
    bf16, f32 output, in the ``WIDENED_SCOPE`` scope), scaled by the blocks' scales ``sa``
    [F1, nb] and ``sb`` [F2, nb] (a's first) and added into one f32 accumulator, blocks in
    order; ``transposed``: the same products laid out [F2, F1] (as the batched form).

    XLA:CPU converts the operands of a batched bf16 dot (the other per-block form) to f32
    and runs an f32 GEMM; a 2-D bf16 x bf16 -> f32 dot runs its bf16 GEMM (forward and
    backward of a blockwise 256 x 1024 x 1024 layer: 0.68x the time, 2026-12-02). The loop
    (faster on XLA:CPU than the same C / g dots unrolled) keeps one dot equation per GEMM
    whatever the contraction (a jaxpr reader sees one GEMM, FLOPs times the scan length) and
    one partial product live at a time.

    Same exact products as the batched form; the f32 roundings may differ: XLA:CPU's bf16
    GEMM sums a block's 128 products in another order than its f32 GEMM (under 1% of the
    partials differ, in the last bit) and may fuse the last scale multiply and the
    accumulation into one FMA (one rounding fewer). Both stay within the f32 summation bound
    of the exact block-scaled sum, and are bit-identical wherever that sum is exact in f32.
    """
    ca, cb = int(not a.cmajor), int(not b.cmajor)  # the stored axis each one contracts
    av, bv = a.sa.values.astype(_WIDE_DTYPE), b.sa.values.astype(_WIDE_DTYPE)

    def step(acc, i):
        pa = lax.dynamic_slice_in_dim(av, i * g, g, axis=ca)
        pb = lax.dynamic_slice_in_dim(bv, i * g, g, axis=cb)
        s1 = lax.dynamic_slice_in_dim(sa, i, 1, axis=1)  # [F1, 1]
        s2 = lax.dynamic_slice_in_dim(sb, i, 1, axis=1)  # [F2, 1]
        with jax.named_scope(_scope(a, b)):
            if transposed:
                part = lax.dot_general(pb, pa, (((cb,), (ca,)), ((), ())),
                                       preferred_element_type=jnp.float32)
                return acc + part * s1.T * s2, None
            part = lax.dot_general(pa, pb, (((ca,), (cb,)), ((), ())),
                                   preferred_element_type=jnp.float32)
            return acc + part * s1 * s2.T, None

    fa, fb = a.shape[0], b.shape[0]
    acc = jnp.zeros((fb, fa) if transposed else (fa, fb), jnp.float32)
    return lax.scan(step, acc, jnp.arange(sa.shape[1]), unroll=_BLOCK_DOTS_UNROLL)[0]


_SCAN_BLOCK_DOTS = True
"""Private switch of the per-block 2-D dots off GPUs (``_block_dots``); tests turn it off to
compare with the batched per-block dot it replaces."""

_BLOCK_DOTS_UNROLL = 2
"""Blocks per loop iteration of ``_block_dots``' scan: two made the blockwise fp8-step 4-8%
faster than one in four A/B runs (dense and mlp, XLA:CPU, 2026-12-02); all blocks unrolled
into separate dots was slower than either. (XLA fuses the two steps' multiply-adds on its
own terms, so the f32 roundings depend on it, within the same summation bound.)"""

_MIN_SCAN_BLOCK = 128
"""Smallest contraction block ``_block_dots`` takes. A [F1, 128] x [128, F2] bf16 dot runs
XLA:CPU's bf16 GEMM well (blockwise: DeepSeek-V3's 128); NVFP4's 16-wide blocks would make 8x
as many thin dots, measured 1.5x slower than the batched form (512-wide layer, 2026-12-02)."""

WIDENED_SCOPE = "fmtkit_fp8_widened"
"""Prefix of the named scope around an emulated FP8 GEMM's dot whose operands enter it
widened off GPUs (``_emulated_dot``; scales folded in by ``_folds_scales``, or not),
``fmtkit_fp8_widened-<lhs format>-<rhs format>`` (e.g.
``fmtkit_fp8_widened-float8_e4m3fn-float8_e4m3fn``): its dot reads bf16 operands, and a jaxpr
reader (``fmtkit.policy.inspect_policy``) reports the FP8 formats the GEMM computes in."""

_FOLD_POW2_SCALES = True
"""Private switch of the power-of-two fold (``_folds_scales``); tests turn it off to compare
the fold with the per-block form it replaces."""

_WIDEN_OFF_GPU = True
"""Private switch of the bf16 widening of FP8 dot operands off GPUs (``_emulated_dot``); tests
turn it off to compare with the FP8 dot it replaces."""

_WIDE_DTYPE = jnp.bfloat16
"""The dtype FP8 dot operands enter the dot in off GPUs (and the folded operands'): bf16
holds every FP8 element exactly (E4M3 / E5M2 have at most 4 significant bits and bf16's
exponent range covers theirs; a folded element is such a value times a power of two),
and XLA:CPU runs a bf16 x bf16 -> f32 dot (f32 accumulation) about 4x faster than the f32
GEMM it makes of an f32 or FP8 dot: it converts FP8 operands to f32 first (0.41 vs 1.76 ms
at 512³, 2026-12-02)."""


def _scope(a: _Operand, b: _Operand) -> str:
    return f"{WIDENED_SCOPE}-{a.sa.fmt.name}-{b.sa.fmt.name}"


def _widens(values: jax.Array) -> bool:
    """Whether ``_emulated_dot`` widens these stored values: off GPUs, a format bf16 holds
    exactly (at most 8 significant bits, exponents within bf16's)."""
    fi = jnp.finfo(values.dtype)
    wide = jnp.finfo(_WIDE_DTYPE)
    return (_WIDEN_OFF_GPU and fi.bits < 16 and fi.nmant <= wide.nmant
            and fi.maxexp <= wide.maxexp and fi.minexp >= wide.minexp and not _on_gpu())


def _emulated_dot(a: _Operand, b: _Operand, av: jax.Array, bv: jax.Array, dims) -> jax.Array:
    """``lax.dot_general(av, bv, dims)`` with f32 accumulation of the stored FP8 values
    ``av`` (of ``a``) and ``bv`` (of ``b``). On a GPU they enter the dot as FP8 (the FP8
    GEMM contract). Off GPUs they enter it widened to bf16 (``_WIDE_DTYPE``), in the
    ``WIDENED_SCOPE`` scope that names their formats: the same values (bf16 holds every
    FP8 element), the same exact products in f32, summed in f32 (only the summation order
    may differ from the f32 GEMM XLA:CPU makes of an FP8 dot), at about 4x the speed."""
    if not (_widens(av) and _widens(bv)):
        return lax.dot_general(av, bv, dims, preferred_element_type=jnp.float32)
    with jax.named_scope(_scope(a, b)):
        return _wide_dot(av.astype(_WIDE_DTYPE), bv.astype(_WIDE_DTYPE), dims)


def _wide_dot(av: jax.Array, bv: jax.Array, dims) -> jax.Array:
    """``lax.dot_general(av, bv, dims)`` of bf16 operands into f32, in a form XLA:CPU runs.

    XLA:CPU (jax 0.11) rejects some batched bf16 x bf16 -> f32 dots ("Unsupported element
    type for DotThunk::Execute") where the two operands' batch and contraction axes sit in
    different places (the per-block partials of a contraction-major operand with a
    contraction-minor one): batched operands are laid out [batch, free, contraction] first
    (the transpose fuses with the widening into one pass). Same output and layout
    [batch, a free, b free] as ``lax.dot_general``."""
    (ca, cb), (ba, bb) = dims
    if ba:
        free_a = [d for d in range(av.ndim) if d not in (*ca, *ba)]
        free_b = [d for d in range(bv.ndim) if d not in (*cb, *bb)]
        av = jnp.transpose(av, (*ba, *free_a, *ca))
        bv = jnp.transpose(bv, (*bb, *free_b, *cb))
        n = len(ba)
        dims = ((tuple(range(av.ndim - len(ca), av.ndim)),
                 tuple(range(bv.ndim - len(cb), bv.ndim))),
                (tuple(range(n)), tuple(range(n))))
    return lax.dot_general(av, bv, dims, preferred_element_type=jnp.float32)


def _pow2_scales(sa: ScaledArray) -> bool:
    """Whether every scale of ``sa`` is a power of two: E8M0 (MX) or ``power_of_two``."""
    return sa.scale.dtype == jnp.float8_e8m0fnu or bool(
        getattr(sa.recipe, "power_of_two", False))


def _folds_scales(a: ScaledArray, b: ScaledArray) -> bool:
    """Whether ``scaled_matmul`` folds the per-block scales into the operands and runs one
    f32 dot over the whole contraction instead of one FP8 dot per block.

    Where both operands' scales are powers of two, ``values * scale`` is exact (a power of
    two only shifts the exponent; held in bf16, ``_WIDE_DTYPE``), and so is each product of
    two such elements in the dot's f32 accumulation (at most 4 + 4 significant bits of
    FP8 x FP8, 24 available): the one dot sums the same
    exact products as the per-block partials ``(a_q · b_q) * sa * sb``; only the order of
    the f32 summation differs (which XLA's dot does not fix either). Bounds: exact while
    the dequantized elements and their products are f32 normals (above 2^-126, the range
    an f32 matmul of the unquantized inputs itself keeps: a block's dequantized elements
    are its inputs rounded to the FP8 grid, within 2x of its amax), so the two forms can
    differ only for products below 2^-126 (XLA:CPU flushes those to zero; the per-block form
    may keep a sum of such products) or outputs beyond f32's range.

    Done only off GPUs: there every dot reads widened operands anyway (``_emulated_dot``;
    the widening and the scale fuse into one pass), and the per-block form costs C/32
    partial products of the output's size. On a GPU the FP8 operands go into the dot
    (per block), as the FP8 GEMM contract requires.
    """
    return (_FOLD_POW2_SCALES and _pow2_scales(a) and _pow2_scales(b) and not _on_gpu())


def _row_scales(op: _Operand) -> jax.Array:
    """f32 scales [F, 1] (or [1, 1]) of an operand whose scale is constant along C."""
    s = op.scale().astype(jnp.float32)
    if op.block[0] > 1 and s.shape[0] > 1:
        s = jnp.repeat(s, op.block[0], axis=0)
    return s


PARTIALS_BUDGET_BYTES = 32 * 2**20
"""Most bytes of f32 per-block partial products ``scaled_matmul`` materializes at once where
they come from batched dots (on a GPU, and for blocks narrower than 128): below it, all
partials come from one batched dot (a 512 x 512 output with 16 MX blocks is 16 MiB; the loop
form is several times slower on CPU at such sizes); above it (a 4096 x 7168 output is 112 MiB
per partial), blocks are accumulated one at a time."""


def _block_scale(op: _Operand, g: int) -> jax.Array:
    """f32 scale [F / bf, C / g] (repeated along C when the operand's blocks exceed g)."""
    s = op.scale().astype(jnp.float32)
    c = op.shape[1]
    if s.shape[1] != c // g:
        s = jnp.repeat(s, (c // g) // s.shape[1], axis=1)
    return s


def _rows(s: jax.Array, f: int) -> jax.Array:
    """Per-block-of-rows scales [F / bf, n] broadcast to [F, n]."""
    if s.shape[0] == f:
        return s
    n = s.shape[1]
    return jnp.broadcast_to(s[:, None, :], (s.shape[0], f // s.shape[0], n)).reshape(f, n)


def _kernel_backend(recipe: Fp8Recipe, a: ScaledArray, b: ScaledArray
                    ) -> tuple[GemmBackend, str] | None:
    """The registered kernel and its ``impl`` for this GEMM, or None for ``scaled_matmul``."""
    if recipe.use_kernel == "never" or recipe.accum_mantissa_bits is not None:
        return None
    if recipe.use_kernel == "auto" and not _on_gpu():
        return None  # no kernel package is loaded where none could run compiled
    for backend in gemm_backends().values():
        if not backend.applies(a, b):
            continue
        if recipe.use_kernel == "interpret":
            return backend, "interpret"
        if backend.available():
            return backend, "kernel"
    return None


# Blackwell parts (compute capability 10.x), whose tensor cores take MX block scales.
_BLACKWELL_KINDS = ("B100", "B200", "B300", "GB200", "GB300")
_MX_ELEMENTS = ("float8_e4m3fn", "float8_e5m2")


def on_blackwell() -> bool:
    """Whether this trace targets a Blackwell GPU (block-scaled tensor cores): an abstract
    mesh's device (cross-lowering without one), else the default device."""
    device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
    if device is None:
        if jax.default_backend() != "gpu":
            return False
        device = jax.devices()[0]
        cc = getattr(device, "compute_capability", None)
        if cc is not None:
            return str(cc).split(".")[0] == "10"
    return device.platform == "gpu" and any(
        k in getattr(device, "device_kind", "") for k in _BLACKWELL_KINDS)


def _fits_block_scaled_dot(a: ScaledArray, b: ScaledArray) -> bool:
    """MXFP8 operands: E4M3/E5M2 elements in 1x32 blocks along C with E8M0 scales."""
    return all(t.block == (1, 32) and t.fmt.name in _MX_ELEMENTS
               and t.scale.dtype == jnp.float8_e8m0fnu for t in (a, b))


def _block_scaled_dot(a_values, a_scale, b_values, b_scale, *, impl, out_dtype):
    """JAX's native block-scaled dot (``jax.nn.scaled_matmul``): XLA's ``block_scaled_dot``,
    run by cuDNN on Blackwell; elsewhere (``impl="interpret"``) JAX's own decomposition."""
    del impl
    return jax.nn.scaled_matmul(a_values[None], b_values[None], a_scale[None], b_scale[None],
                                preferred_element_type=jnp.float32)[0].astype(out_dtype)


register_gemm_backend("jax_block_scaled_dot", _block_scaled_dot,
                      applies=_fits_block_scaled_dot, available=on_blackwell)


def _on_gpu() -> bool:
    """Whether this trace targets a GPU (an abstract mesh's device, else the default one)."""
    device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
    if device is not None:
        return device.platform == "gpu"
    return jax.default_backend() == "gpu"


def _gemm(a: _Operand, b: _Operand, recipe: Fp8Recipe, out_dtype=jnp.float32,
          transposed: bool = False) -> jax.Array:
    """``a · bᵀ`` [F1, F2] through a registered kernel or ``scaled_matmul``; ``transposed``:
    its transpose [F2, F1] (same bits), produced in that layout where it can be."""
    found = None
    if recipe.use_kernel == "interpret" or (recipe.use_kernel == "auto" and _on_gpu()):
        found = _kernel_backend(recipe, a.logical(), b.logical())
    if found is not None:
        a, b = a.logical(), b.logical()
        backend, impl = found
        out = backend.fn(a.values, a.scale, b.values, b.scale, impl=impl,
                         out_dtype=out_dtype)
        return out.T if transposed else out
    return _scaled_matmul(a, b, recipe, transposed=transposed).astype(out_dtype)


def _gemm_dtype(consumer_dtype) -> jnp.dtype:
    """A GEMM's output dtype: bf16 where its consumer is bf16 (one rounding of the f32
    accumulation either way), else f32."""
    return jnp.dtype(jnp.bfloat16 if consumer_dtype == jnp.bfloat16 else jnp.float32)


# ---------------------------------------------------------------------------------------------
# The custom-VJP core on 2-D operands: x [M, K], w [N, K] (K-major), y [M, N].
#
# Each dimension that a tiling blocks is zero-padded inside the GEMM that needs it (a GEMM
# of a [F1, C] and b [F2, C] pads C to both operands' contraction blocks and each F to its
# operand's free block) and the result is sliced back, so any shape trains.
# Quantized operands whose tiling is the same along both axes (per tensor, unscaled, square
# blocks) are kept from the forward pass and transposed for the backward GEMMs: quantizing
# the transpose would give the same values and scales, so only the tilings that change with
# the contraction axis (rows, 1x128 tiles, MX blocks) are quantized again from x / w / dy.


def _amax(t: jax.Array, recipe: Fp8Recipe) -> jax.Array:
    # max |t| in t's own dtype, then f32: exact (|t| and max only pick elements), and a
    # bf16 operand is read once instead of converted into an f32 copy first (in the bf16
    # bench MLP the f32 form cost about 10% of the step on XLA:CPU, 2026-12-02).
    amax = jnp.max(jnp.abs(t)).astype(jnp.float32)
    for axis in recipe.amax_reduce_axes:
        amax = lax.pmax(amax, axis)
    return amax


def _tensor_amax(recipe: Fp8Recipe, tile: _Tile, hist_row: jax.Array, t: jax.Array,
                 current: jax.Array) -> jax.Array | None:
    """The amax a per-tensor operand ``t`` is quantized with: for delayed recipes its
    history's (``t``'s own amax only before the first recorded step, computed under
    ``lax.cond``: see ``delayed_amax_of``), else ``current`` (possibly mesh-reduced); None for
    other tilings (they use their blocks)."""
    if recipe.delayed:
        return delayed_amax_of(hist_row, t, functools.partial(_amax, recipe=recipe),
                               recipe.amax_algo)
    return current if tile.kind == "tensor" else None


def _c_to(c: int, *tiles: _Tile) -> int:
    return _round_up(c, math.lcm(*(max(t.c, 1) for t in tiles)))


def _tiles(recipe: Fp8Recipe) -> tuple[_Tile, _Tile, _Tile]:
    return _tile(recipe.x_tile), _tile(recipe.w_tile), _tile(recipe.grad_tile)


# Named scopes of the backward GEMMs, so a jaxpr reader (``fmtkit.policy.inspect_policy``)
# tells the data gradient from the weight gradient without guessing from shapes.
DGRAD_SCOPE = "fmtkit_dgrad"
WGRAD_SCOPE = "fmtkit_wgrad"


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _core(recipe: Fp8Recipe, out_dtype, x: jax.Array, w: jax.Array, hist: jax.Array
          ) -> jax.Array:
    return _core_fwd(recipe, out_dtype, x, w, hist)[0]


def _core_fwd(recipe, out_dtype, x, w, hist):
    tx, tw, _ = _tiles(recipe)
    m, k = x.shape
    n = w.shape[0]
    # w.T (here and for the delayed bootstrap): w is usually the transpose of a [K, N]
    # kernel (_canonicalize), and a max over all elements is order-free: reducing the
    # un-transposed kernel avoids a transposed copy.
    amax_x, amax_w = _amax(x, recipe), _amax(w.T, recipe)
    kp = _c_to(k, tx, tw)
    xq = _operand(x, recipe.x_format, tx, recipe,
                  _tensor_amax(recipe, tx, hist[0], x, amax_x), kp)
    # w is quantized as w.T [K, N] (contraction-major: see _Operand), the kernel's layout.
    wq = _operand(w.T, recipe.w_format, tw, recipe,
                  _tensor_amax(recipe, tw, hist[1], w.T, amax_w), kp, cmajor=True)
    y = _gemm(xq, wq, recipe, _gemm_dtype(out_dtype))[:m, :n]
    # Residuals: the quantized operand where the backward GEMMs can reuse it, else the input.
    # (Empty arrays carry K and the input dtypes: residuals must be arrays.)
    return y, (xq if tx.transposable else x, wq if tw.transposable else w, hist,
               amax_x, amax_w, jnp.zeros((0, k), x.dtype), jnp.zeros((0,), w.dtype))


def _backward_operand(res: jax.Array | _Operand, fmt: str, tile: _Tile,
                      recipe: Fp8Recipe, hist_row: jax.Array, amax: jax.Array, k: int,
                      c_to: int, *, stored_transposed: bool) -> _Operand:
    """A forward operand ([F, K], saved by ``_core_fwd``) as a backward GEMM reads it,
    contracting F: its quantized forward value transposed where the tile allows, else the
    saved input re-quantized along the new contraction (padded to ``c_to`` columns), in the
    layout it is stored in: ``stored_transposed`` (w, the transpose of a [K, N] kernel) is
    quantized from ``res.T``, otherwise (x [M, K]) ``res`` is quantized contraction-major."""
    if tile.transposable:
        return _transpose(res, _round_up(k, tile.f), c_to)
    amax = _tensor_amax(recipe, tile, hist_row, res, amax)
    if stored_transposed:
        return _operand(res.T, fmt, tile, recipe, amax, c_to)
    return _operand(res, fmt, tile, recipe, amax, c_to, cmajor=True)


def _core_bwd(recipe, out_dtype, res, g):
    del out_dtype
    g = g.astype(jnp.float32)  # as when the forward GEMM returned f32 (exact from bf16)
    x_res, w_res, hist, amax_x, amax_w, x_meta, w_meta = res
    m, n = g.shape
    k, x_dtype, w_dtype = x_meta.shape[1], x_meta.dtype, w_meta.dtype
    tx, tw, tg = _tiles(recipe)
    amax_g = _amax(g, recipe)
    d_g = _tensor_amax(recipe, tg, hist[2], g, amax_g)
    # dgrad: dx [M, K] = g [M, N] · w [N, K], contracting N.
    np_ = _c_to(n, tg, tw)
    gq_n = _operand(g, recipe.grad_format, tg, recipe, d_g, np_)
    wq_n = _backward_operand(w_res, recipe.w_format, tw, recipe, hist[1], amax_w, k, np_,
                             stored_transposed=True)
    with jax.named_scope(DGRAD_SCOPE):
        dx = _gemm(gq_n, wq_n, recipe, _gemm_dtype(x_dtype))[:m, :k].astype(x_dtype)
    # wgrad: dw [N, K] = gᵀ [N, M] · x [M, K], contracting the tokens M.
    mp = _c_to(m, tg, tx)
    if tg.transposable and tg.kind != "block":
        # per tensor / unscaled: the dgrad operand, transposed (square blocks would need the
        # same padding along M and N; re-quantizing g is as cheap as padding it again)
        gq_m = _transpose(gq_n, _round_up(n, tg.f), mp)
    else:
        gq_m = _operand(g, recipe.grad_format, tg, recipe, d_g, mp, cmajor=True)
    xq_m = _backward_operand(x_res, recipe.x_format, tx, recipe, hist[0], amax_x, k, mp,
                             stored_transposed=False)
    # Computed as dwᵀ [K, N]: the kernel's layout when w was given as [K, N] (a Dense
    # kernel), so the transpose back cancels with _canonicalize's.
    with jax.named_scope(WGRAD_SCOPE):
        dw = _gemm(gq_m, xq_m, recipe, transposed=True)[:k, :n].astype(w_dtype).T
    observed = jnp.zeros_like(hist)  # only a delayed recipe's history observes the amaxes
    if recipe.delayed:  # (elsewhere a per-shard amax under shard_map would not type-check)
        observed = observed.at[:, 0].set(jnp.stack([amax_x, amax_w, amax_g]))
    return dx, dw, observed


_core.defvjp(_core_fwd, _core_bwd)


# ---------------------------------------------------------------------------------------------
# lax.dot_general's signature.


def _canonicalize(lhs, rhs, dimension_numbers):
    (lc, rc), (lb, rb) = dimension_numbers
    if len(lc) != len(rc) or len(lb) != len(rb):
        raise ValueError("lhs and rhs need as many contracting (and batch) dims")
    for dl, dr in ((lc, rc), (lb, rb)):
        for a, b in zip(dl, dr):
            if lhs.shape[a] != rhs.shape[b]:
                raise ValueError(f"lhs dim {a} (size {lhs.shape[a]}) and rhs dim {b} "
                                 f"(size {rhs.shape[b]}) differ")
    lc, rc, lb, rb = (tuple(int(d) % a.ndim for d in ds)
                      for ds, a in ((lc, lhs), (rc, rhs), (lb, lhs), (rb, rhs)))
    lf = [d for d in range(lhs.ndim) if d not in lc and d not in lb]
    rf = [d for d in range(rhs.ndim) if d not in rc and d not in rb]
    batch = [lhs.shape[d] for d in lb]
    m = math.prod(lhs.shape[d] for d in lf)
    n = math.prod(rhs.shape[d] for d in rf)
    k = math.prod(lhs.shape[d] for d in lc)
    x = lhs.transpose(*lb, *lf, *lc).reshape(*batch, m, k)
    w = rhs.transpose(*rb, *rf, *rc).reshape(*batch, n, k)
    out_shape = (*batch, *(lhs.shape[d] for d in lf), *(rhs.shape[d] for d in rf))
    return x, w, len(batch), out_shape


_DEFAULT_PRECISIONS = (None, lax.Precision.DEFAULT)


def _check_precision(precision: Any, where: str) -> None:
    """Accepts ``precision`` values that ask for nothing beyond an FP8 GEMM (None, DEFAULT,
    or a pair of those); raises on HIGH / HIGHEST / an algorithm, which it cannot honour."""
    ps = precision if isinstance(precision, tuple | list) else (precision,)
    for p in ps:
        if isinstance(p, str):
            try:
                p = lax.Precision(p)
            except (ValueError, KeyError):
                raise ValueError(f"{where}: precision={precision!r} is not a lax.Precision; "
                                 "use None or lax.Precision.DEFAULT.") from None
        if p not in _DEFAULT_PRECISIONS:
            raise ValueError(
                f"{where}: precision={precision!r} asks for more precise products than an "
                "FP8 GEMM computes (its products are FP8 x FP8, exact, accumulated in f32 by "
                "construction). Drop precision (None / lax.Precision.DEFAULT), or keep this "
                "matmul out of the FP8 recipe (e.g. a bf16/f32 rule for its module).")


def _check_out_sharding(out_sharding: Any, where: str) -> None:
    if out_sharding is not None and not isinstance(
            out_sharding, jax.sharding.Sharding | jax.sharding.PartitionSpec):
        raise TypeError(f"{where}: out_sharding must be None, a jax.sharding.Sharding or a "
                        f"PartitionSpec (as for lax.dot_general), got {out_sharding!r}.")


def _check_out_dtype(preferred_element_type: Any, where: str) -> Any:
    if preferred_element_type is None:
        return None
    try:
        dtype = jnp.dtype(preferred_element_type)
    except TypeError:
        dtype = None
    if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"{where}: preferred_element_type must be a floating dtype (the "
                        f"output dtype; the GEMMs accumulate in f32), got "
                        f"{preferred_element_type!r}.")
    return dtype


def _where(recipe: Fp8Recipe, name: str | None) -> str:
    return (f"fmtkit.fp8.dot_general({recipe}) at {name!r}" if name else
            f"fmtkit.fp8.dot_general({recipe})")


def _fp8_dot(recipe: Fp8Recipe, where: str, lhs, rhs, dimension_numbers, precision,
             preferred_element_type, out_sharding, fp8_state):
    """The op behind ``dot_general`` and the functions ``dot_general_fn`` returns."""
    _check_precision(precision, where)
    _check_out_sharding(out_sharding, where)
    preferred_element_type = _check_out_dtype(preferred_element_type, where)
    try:
        lhs = check_floating(lhs, "lhs")
        rhs = check_floating(rhs, "rhs")
    except TypeError as e:
        raise TypeError(f"{where}: {e}") from None
    out_dtype = preferred_element_type or (
        lhs.dtype if lhs.dtype == rhs.dtype else jnp.float32)
    if recipe.delayed and fp8_state is None:
        raise ValueError(f"{where}: recipe {recipe.name!r} is delayed: pass fp8_state= "
                         "(see fmtkit.fp8.init_state) or use the Flax module wrappers.")
    try:
        x, w, nbatch, out_shape = _canonicalize(lhs, rhs, dimension_numbers)
    except (ValueError, TypeError, IndexError) as e:
        raise ValueError(f"{where}: bad dimension_numbers {dimension_numbers!r} for "
                         f"lhs {lhs.shape} and rhs {rhs.shape}: {e}") from None
    if recipe.delayed:
        # A batched dot (per-expert GEMMs, "egcd,edf->egcf") keeps one history per batch
        # element, [*batch, 3, history]: each expert's weights get their own scale.
        hist = jnp.asarray(fp8_state.amax_history)
        need = (*x.shape[:nbatch], 3, recipe.history)
        if hist.shape != need:
            extra = (" A stack of layers (nn.scan / nnx.scan) keeps one history per "
                     "layer, [L, 3, history]: scan over the fp8_state collection too "
                     "(linen: variable_axes={'params': 0, 'fp8_state': 0}) so each "
                     "layer's dot sees its own slice." if hist.ndim == len(need) + 1
                     else "")
            raise ValueError(f"{where}: fp8_state.amax_history has shape {hist.shape}; "
                             f"this dot needs {need} (one history per batch element; "
                             "rows x, w, grad)." + extra)
    else:
        hist = jnp.zeros((3, 1), jnp.float32)
    if x.size == 0 or w.size == 0:
        # An empty operand (no tokens, an empty contraction, no features): lax.dot_general's
        # answer, zeros of the output shape (empty, or a sum over nothing); no GEMM to run.
        y = jnp.zeros(out_shape, out_dtype)
    else:
        # A recipe subclass may bring its own custom-VJP core (fmtkit.fp4.Fp4Recipe).
        core = functools.partial(getattr(type(recipe), "gemm_core", _core), recipe,
                                 _gemm_dtype(out_dtype))
        for _ in range(nbatch):
            core = jax.vmap(core, in_axes=(0, 0, 0 if recipe.delayed else None))
        y = core(x, w, hist).reshape(out_shape).astype(out_dtype)
    if out_sharding is not None:
        y = jax.sharding.reshard(y, out_sharding)
    return y


def dot_general_fn(recipe: str | Fp8Recipe = "blockwise", *, name: str | None = None):
    """Returns a function with ``lax.dot_general``'s signature that computes in FP8.

    Plugs into ``nn.Dense(dot_general=...)``, ``nn.DenseGeneral``, ``nn.Einsum`` and
    ``nnx.Linear(dot_general=...)``. Any contracting and batch dims are accepted (they are
    flattened to a 2-D GEMM per batch element), of any size: a dimension that a recipe's
    blocks do not divide is zero-padded inside each GEMM (exact). Delayed recipes take their
    state as the keyword ``fp8_state`` (an ``Fp8DotState``); the linen / NNX module wrappers
    in ``fmtkit.policy`` thread it for you.

    ``lax.dot_general``'s keywords are taken by name: ``preferred_element_type`` is the
    output dtype (a floating dtype; the GEMMs accumulate in f32), ``out_sharding`` the
    output's sharding (``jax.sharding.reshard``), ``precision`` only None or
    ``lax.Precision.DEFAULT`` (FP8 products are exact and accumulated in f32 by
    construction: HIGH / HIGHEST raise instead of being ignored). Any other keyword is a
    ``TypeError``.

    Args:
      recipe: a name from ``RECIPES`` or an ``Fp8Recipe``.
      name: what the errors of the returned function call this dot (the policy layer passes
        the module path, e.g. "Block_0/MlpBlock_0/Dense_0").

    Returns:
      ``fp8_dot_general(lhs, rhs, dimension_numbers, precision=None,
      preferred_element_type=None, *, out_sharding=None, fp8_state=None)``.

    Example:
      >>> dg = dot_general_fn("blockwise")
      >>> x, w = jnp.ones((128, 200)), jnp.ones((200, 100))
      >>> dg(x, w, (((1,), (0,)), ((), ()))).shape
      (128, 100)
    """
    recipe = get_recipe(recipe)
    where = _where(recipe, name)

    def fp8_dot_general(lhs, rhs, dimension_numbers, precision=None,
                        preferred_element_type=None, *, out_sharding=None,
                        fp8_state: Fp8DotState | None = None):
        return _fp8_dot(recipe, where, lhs, rhs, dimension_numbers, precision,
                        preferred_element_type, out_sharding, fp8_state)

    fp8_dot_general.recipe = recipe  # type: ignore[attr-defined]
    fp8_dot_general.name = name  # type: ignore[attr-defined]
    return fp8_dot_general


_UNSET: Any = object()  # "no operand": dot_general() / dot_general(recipe=...), the factory


def dot_general(lhs: Any = _UNSET, rhs: jax.typing.ArrayLike | None = None,
                dimension_numbers: Any = None, precision: Any = None,
                preferred_element_type: jax.typing.DTypeLike | None = None, *,
                out_sharding: Any = None, recipe: str | Fp8Recipe | None = None,
                fp8_state: Fp8DotState | None = None, name: str | None = None):
    """``lax.dot_general`` in FP8: the op, or (given only a recipe) a function like it.

    ``dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None,
    *, out_sharding=None, recipe="blockwise", fp8_state=None)`` computes the product with the
    recipe's three FP8 GEMMs (custom VJP; see ``dot_general_fn`` for the keywords' meaning).

    ``dot_general(recipe)`` (a name or an ``Fp8Recipe`` as the only positional argument, or
    ``dot_general(recipe=...)`` with no operands) is ``dot_general_fn(recipe, name=name)``,
    the factory, kept for ``nn.Dense(dot_general=fp8.dot_general("blockwise"))``: the first
    argument of the op is an array, never a string or a recipe, so the two cannot be confused.

    Example:
      >>> x, w = jnp.ones((128, 200)), jnp.ones((200, 100))
      >>> dot_general(x, w, (((1,), (0,)), ((), ())), recipe="current").shape
      (128, 100)
      >>> dot_general("current")(x, w, (((1,), (0,)), ((), ()))).shape
      (128, 100)
    """
    if lhs is None:
        raise TypeError("fmtkit.fp8.dot_general: lhs is None; pass an array (the op) or a "
                        "recipe name / Fp8Recipe (the factory).")
    if lhs is _UNSET or isinstance(lhs, str | Fp8Recipe):
        extra = {k: v for k, v in dict(
            rhs=rhs, dimension_numbers=dimension_numbers, precision=precision,
            preferred_element_type=preferred_element_type, out_sharding=out_sharding,
            fp8_state=fp8_state).items() if v is not None}
        if lhs is not _UNSET and recipe is not None:
            raise TypeError("fmtkit.fp8.dot_general: the recipe was given twice "
                            f"({lhs!r} and recipe={recipe!r}).")
        if extra:
            raise TypeError(
                "fmtkit.fp8.dot_general: called with a recipe first, it returns the FP8 "
                f"function (dot_general_fn); the operands go to that function, got "
                f"{', '.join(extra)} here. The op takes the arrays first: "
                "dot_general(lhs, rhs, dimension_numbers, recipe=...).")
        if lhs is _UNSET:
            lhs = "blockwise" if recipe is None else recipe
        return dot_general_fn(lhs, name=name)
    if rhs is None or dimension_numbers is None:
        raise TypeError("fmtkit.fp8.dot_general(lhs, rhs, dimension_numbers, ...): rhs and "
                        "dimension_numbers are required (or pass only a recipe to get the "
                        "FP8 function).")
    r = get_recipe("blockwise" if recipe is None else recipe)
    return _fp8_dot(r, _where(r, name), lhs, rhs, dimension_numbers, precision,
                    preferred_element_type, out_sharding, fp8_state)
