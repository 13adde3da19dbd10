"""Recipes: ``Fp8Recipe`` (how the three GEMMs of a scaled ``dot_general`` quantize their
operands), its FP4 subclass ``Fp4Recipe``, the named recipes of both families,
``get_recipe``, which takes a name of either, and the tilings the recipes own (``Tile``: how
an operand is blocked, and the ``fmtkit.scaling`` recipe of each block).

``Fp4Recipe`` subclasses ``Fp8Recipe`` on purpose: the policy's rules, ``dot_general_fn`` and
users' code take "a recipe" as an ``Fp8Recipe`` (``isinstance``), and an FP4 recipe goes
everywhere an FP8 one goes.

An FP4 recipe goes wherever an FP8 recipe goes (``fmtkit.fp8.dot_general_fn``, policies,
rules): the names of both families are one namespace (``fmtkit.fp8.RECIPES`` holds the FP8
ones, ``fmtkit.fp4.RECIPES`` the FP4 ones; no name is in both).
"""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Any, Literal, NamedTuple

from fmtkit._lowp.fp4_quant import E2M1, ROUNDINGS
from fmtkit.formats import get_format
from fmtkit.scaling import (
    AxisScaling,
    BlockScaling,
    DelayedScaling,
    MXScaling,
    Recipe,
    TensorScaling,
)

# Tilings: how a recipe blocks each operand, given for the operand laid out
# [free, contraction]; the operands and GEMMs read them from the recipe.

_TILE_RE = re.compile(r"^(tensor|row|none|mx(\d+)|(\d+)x(\d+))$")


def parse_tile(spec: str, arg: str) -> tuple[str, tuple[int, int] | int | None]:
    """``(kind, arg)`` of a tiling spec: ("mx", 32) for "mx32", ("block", (1, 128)) for
    "1x128", (spec, None) for "tensor", "row", "none"; ``arg`` names the field in the error."""
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


class Tile(NamedTuple):
    """A parsed tiling (``tile_of``) of a ``[free, contraction]`` operand."""

    kind: str  # "tensor", "row", "none", "mx", "block"
    f: int  # block along the free dim (1 for per-row tiles and MX; 0: whole dim)
    c: int  # block along the contraction (0: the whole dim)
    arg: Any

    @property
    def transposable(self) -> bool:
        """Quantizing t.T gives the transpose of quantizing t (same blocks, same scales)."""
        return self.kind in ("tensor", "none") or (self.kind == "block" and self.f == self.c)


@functools.cache
def tile_of(spec: str) -> Tile:
    """The ``Tile`` of a (valid) tiling spec."""
    kind, arg = parse_tile(spec, "tile")
    if kind == "mx":
        return Tile(kind, 1, arg, arg)
    if kind == "block":
        return Tile(kind, arg[0], arg[1], arg)
    if kind == "row":
        return Tile(kind, 1, 0, None)
    return Tile(kind, 0, 0, None)


def scaling_of(tile: Tile, recipe: Fp8Recipe, cmajor: bool = False) -> Recipe | None:
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


def recipe_tiles(recipe: Fp8Recipe) -> tuple[Tile, Tile, Tile]:
    """The tiles of a recipe's x, w and grad operands."""
    return tile_of(recipe.x_tile), tile_of(recipe.w_tile), tile_of(recipe.grad_tile)


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

    Spelled like Flax's ``Fp8DotGeneralOp``; ``FP8Recipe``, its earlier name, is a
    deprecated alias.

    Tilings are given for an operand laid out as ``[free, contraction]``: "1x128" is one
    scale per row and 128 contraction elements; "128x128" a square block; "row" one scale
    per row over the whole contraction; "tensor" one scale; "mx32" OCP MX blocks of 32 with
    E8M0 scales; "none" a plain cast (no scale).

    Attributes:
      name: the recipe's name (for tables and CLIs).
      x_format: element format of the activations.
      w_format: element format of the weights.
      grad_format: element format of the output gradients.
      x_tile: tiling of the activations (the same tiling is applied along whichever axis a
        GEMM contracts, so x is re-quantized 128x1 for the weight gradient under "1x128").
      w_tile: tiling of the weights.
      grad_tile: tiling of the output gradients.
      delayed: per-tensor scales from an amax history (needs a
        ``fmtkit.DelayedScalingState``, see ``init_state``).
      history: length of the amax history of a delayed recipe (Transformer Engine's
        default: 1024).
      amax_algo: "max" of the history or its "most_recent" entry (default "max").
      margin: scales leave ``2^margin`` headroom below the format's max (default 0).
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

    Example:
      >>> r = dataclasses.replace(RECIPES["blockwise"], grad_tile="128x128")
      >>> str(r), r.x_tile, r.w_tile
      ("blockwise(grad_tile='128x128')", '1x128', '128x128')
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
        tiles = {a: parse_tile(getattr(self, a), a) for a in ("x_tile", "w_tile", "grad_tile")}
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
        return scaling_of(tile_of(getattr(self, f"{operand}_tile")), self)

    def __str__(self) -> str:
        """The name, plus every field that differs from the named recipe of that name (or,
        for a custom recipe, from ``Fp8Recipe()``, ``Fp4Recipe()`` for an FP4 one):
        ``blockwise(margin=1)``, ``nvfp4(rht_seed=5)``."""
        base = _named_base(self)
        diff = [f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self)
                if f.name != "name" and getattr(self, f.name) != getattr(base, f.name)]
        return f"{self.name}({', '.join(diff)})" if diff else self.name


RECIPES: dict[str, Fp8Recipe] = {
    "current": Fp8Recipe("current"),
    "delayed": Fp8Recipe("delayed", delayed=True),
    "rowwise": Fp8Recipe("rowwise", x_tile="row", w_tile="row", grad_tile="row"),
    "blockwise": Fp8Recipe("blockwise", grad_format="e4m3", x_tile="1x128",
                           w_tile="128x128", grad_tile="1x128"),
    "mxfp8": Fp8Recipe("mxfp8", grad_format="e4m3", x_tile="mx32", w_tile="mx32",
                       grad_tile="mx32"),
}
"""The named FP8 recipes (see ``fmtkit.fp8``'s module docstring)."""



@dataclasses.dataclass(frozen=True)
class Fp4Recipe(Fp8Recipe):
    """An FP4 recipe for ``fmtkit.fp8.dot_general`` (and policies): every ingredient a field.

    A subclass of ``fmtkit.fp8.Fp8Recipe`` (so rules and policies take it wherever they take
    an FP8 recipe); tiles are given for a ``[free, contraction]`` operand as there.

    Attributes:
      block_scale: "e4m3" (NVFP4: E4M3 block scales and an f32 tensor scale; tiles "1xB" or
        "BxB") or "e8m0" (MXFP4: tiles "mxB").
      x_tile: tiling of the activations: NVFP4 "1x16", MXFP4 "mx32".
      w_tile: tiling of the weights: NVFP4 "16x16" (the paper's 2D weight blocks; "1x16"
        re-quantizes the weight along each GEMM's contraction), MXFP4 "mx32".
      grad_tile: tiling of the output gradients: NVFP4 "1x16", MXFP4 "mx32".
      x_rounding: rounding of the activations, "nearest" (RNE) or "stochastic" (the paper:
        SR on activations or weights diverged at 1.2B, appendix E.3).
      w_rounding: rounding of the weights, as ``x_rounding``.
      grad_rounding: rounding of the output gradients; the paper rounds them stochastically.
      rht: the random Hadamard transform on both weight-gradient operands (never on the
        forward or dgrad: no gain there, section 4.2).
      rht_size: the Hadamard size (16: the paper's and TE's; 128 gains little, E.4.2).
      rht_seed: seed of the RHT's sign vector (one vector for every layer and the run).
      sr_seed: seed of the stochastic rounding keys (see the module docstring).

    Example:
      >>> r = FP4_RECIPES["nvfp4"]                      # fmtkit.fp4.RECIPES["nvfp4"]
      >>> r.x_tile, r.w_tile, r.block_scale
      ('1x16', '16x16', 'e4m3')
    """

    # Fp8Recipe's fields with FP4 defaults: a dataclass subclass redeclares a field to change
    # its default, so these lines repeat the shape of Fp8Recipe's on purpose.
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
            f, c = tile_of(spec).f, tile_of(spec).c
            ok = spec.startswith("mx") if self.block_scale == "e8m0" else (
                not spec.startswith("mx") and c > 0 and f in (1, c))
            if not ok:
                allowed = "'mxB' (e.g. 'mx32')" if self.block_scale == "e8m0" else \
                    "'1xB' or 'BxB' (e.g. '1x16', '16x16')"
                raise ValueError(f"{arg}={getattr(self, arg)!r} with block_scale="
                                 f"{self.block_scale!r}: use {allowed}.")
        for arg in ("x_rounding", "w_rounding", "grad_rounding"):
            if getattr(self, arg) not in ROUNDINGS:
                raise ValueError(f"{arg} must be one of {ROUNDINGS}, got "
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

    def scaling(self, operand: Literal["x", "w", "grad"]) -> Any:
        """Not available: NVFP4's two-level scale and FP4 stochastic rounding are no
        ``fmtkit.scaling`` recipe. Use ``nvfp4_quantize`` / ``mxfp4_quantize``.

        Raises:
          TypeError: always.
        """
        raise TypeError(f"FP4 recipe {self.name!r} has no fmtkit.scaling equivalent; quantize "
                        "with fmtkit.fp4.nvfp4_quantize / mxfp4_quantize.")


_NV = Fp4Recipe()
FP4_RECIPES: dict[str, Fp4Recipe] = {
    "nvfp4": _NV,
    "nvfp4-no-rht": dataclasses.replace(_NV, name="nvfp4-no-rht", rht=False),
    "nvfp4-no-sr": dataclasses.replace(_NV, name="nvfp4-no-sr", grad_rounding="nearest"),
    "nvfp4-no-2d": dataclasses.replace(_NV, name="nvfp4-no-2d", w_tile="1x16"),
    "mxfp4": Fp4Recipe("mxfp4", x_tile="mx32", w_tile="mx32", grad_tile="mx32",
                       block_scale="e8m0", rht_size=32),
}
"""The named FP4 recipes (``fmtkit.fp4.RECIPES``): NVFP4 as the paper trains it, the variants
without one ingredient each (RHT, SR, 2D weight blocks) and MXFP4 (same ingredients, 32-blocks
with E8M0 scales and a 32-wide RHT, the paper's MXFP4 setting, section 5)."""


def _named_base(recipe: Fp8Recipe) -> Fp8Recipe:
    """What ``str(recipe)`` lists the differences from: the named recipe of its name and
    family, else the family's default recipe."""
    if isinstance(recipe, Fp4Recipe):
        return FP4_RECIPES.get(recipe.name) or Fp4Recipe()
    return RECIPES.get(recipe.name) or Fp8Recipe()


def get_recipe(recipe: str | Fp8Recipe) -> Fp8Recipe:
    """A recipe by name, FP8 (``fmtkit.fp8.RECIPES``) or FP4 (``fmtkit.fp4.RECIPES``), or the
    recipe itself: every entry point of the FP8 family takes both. The error lists the names.

    Raises:
      ValueError: an unknown name. TypeError: neither a name nor an ``Fp8Recipe``.

    Example:
      >>> get_recipe("blockwise").x_tile, get_recipe("mxfp4").x_tile
      ('1x128', 'mx32')
    """
    if isinstance(recipe, Fp8Recipe):
        return recipe
    if isinstance(recipe, str) and recipe in RECIPES:
        return RECIPES[recipe]
    if isinstance(recipe, str) and recipe in FP4_RECIPES:
        return FP4_RECIPES[recipe]
    if not isinstance(recipe, str):
        raise TypeError(f"recipe must be a name from fmtkit.fp8.RECIPES ({', '.join(RECIPES)}) "
                        f"or fmtkit.fp4.RECIPES ({', '.join(FP4_RECIPES)}), or an Fp8Recipe, got "
                        f"{type(recipe).__name__}.")
    raise ValueError(f"Unknown recipe {recipe!r}; FP8 recipes: {', '.join(RECIPES)}; "
                     f"FP4 recipes: {', '.join(FP4_RECIPES)}.")
