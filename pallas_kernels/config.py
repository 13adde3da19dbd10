"""Frozen tuning configs of the blockwise FP8 matmul kernel and the per-shape heuristic.

A config fixes the CTA output tile (``block_m x block_n``), how the two compute warpgroups
split it, the pipeline depth, the order in which the persistent programs visit output
tiles and whether two CTAs form a cluster sharing one operand by TMA multicast. K is
always walked in 128-wide blocks: the scale granularity of DeepSeek-V3's recipe
and the K of one 128-byte-swizzled FP8 ``wgmma`` group.

Each compute warpgroup owns a ``wg_m x wg_n`` tile that it covers in one or two *passes*
of ``64 x pass_n`` (one ``wgmma`` of M = 64 each; ``pass_n`` is the warpgroup's width up
to 192, else 128): per K block
a pass runs its ``wgmma`` into a fresh f32 accumulator and promotes it, scaled, into the
pass's running f32 sum. Registers bound this (checked in ``TuningConfig.__post_init__``):
the running sums take ``wg_m * wg_n / 128`` f32 registers per thread and the fresh
accumulator ``64 * pass_n / 128``; 128 + 64 at most, against the 232 registers the
warp-specialized pipeline leaves each of two compute warpgroups (Hopper's 64 K registers
per SM, 40 per thread for the TMA warpgroup). Two passes (a 128x128 or 64x256 warpgroup
tile) make a 256x128 or 128x256 CTA tile, which loads a quarter fewer bytes per FLOP from
L2/HBM than 128x128 (1.5x the bytes per K block for 2x the FLOPs).

Shared memory (``smem_bytes`` models Mosaic GPU's allocation exactly;
``tests/pallas_kernels/test_cross_lowering.py`` lowers every shipped config and checks
the model against Mosaic's own count): the ring of FP8 A and B tiles and, with the scales
staged (``scales="smem"``, opt-in), their f32 scales per stage; the output staging of each
compute warpgroup (two 8 KiB slots, or with ``epilogue="tile"`` one slot per chunk of its
tile: ``output_slots``); and the barriers. Stages are the most that fit the
H200's 227 KiB per block; ``pipeline_stages`` then takes the largest count that divides the
number of K blocks, so that one pipeline runs across all the output tiles of a CTA
(``plgpu.emit_pipeline_warp_specialized``'s ``pipeline_state`` needs it).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Literal

import jax.numpy as jnp
import numpy as np

__all__ = ["SHIPPED_CONFIGS", "TuningConfig", "choose_config", "chunks_per_tile",
           "epilogue_n", "epilogue_swizzle", "max_stages", "output_slots",
           "pipeline_stages", "scale_widths", "smem_bytes", "tile_cycles", "tile_scale_shape",
           "with_scales"]

BLOCK_K = 128  # DeepSeek-V3 (arXiv 2412.19437) §3.3.2: scales per 128 K, promotion N_C = 128.
SMEM_BYTES_H200 = 232448  # cudaDevAttrMaxSharedMemoryPerBlockOptin on H100/H200 (227 KiB).
_SMEM_ALIGNMENT = 1024  # Mosaic GPU aligns every shared-memory allocation to 1 KiB
_BARRIER_BYTES = 8  # one mbarrier
# Output staged per warpgroup in the "chunks" epilogue: two 8 KiB slots (double-buffered TMA
# stores) of 64 rows; every staging chunk (a slot's width, ``epilogue_n``) is at most 8 KiB.
_EPILOGUE_BYTES = 16384
# Warpgroup widths of one 64-row pass that are not powers of two (DeepGEMM's BLOCK_N in steps
# of 16 above 128, up to 192: 64 x 192 takes 96 f32 registers a thread of running sums and
# 96 of fresh accumulator). FP8 wgmma needs N a multiple of 8 and at most 256
# (jax/experimental/mosaic/gpu/wgmma.py).
WIDE_PASSES = (144, 160, 176, 192)
# B's block scales staged once per output tile (``scales="smem"``, B scaled per 128x128
# block): each compute warpgroup's buffer holds, per 128-column block its passes meet, the
# scales of every K block, padded to a multiple of 32 (a warpgroup's TMA copy with a barrier
# must move a multiple of 128 bytes: Mosaic GPU divides the expected bytes among its 128
# threads). A TMA box spans at most 256 elements a dimension: K up to 256 blocks (32768).
TILE_SCALE_K_ALIGN = 32
TILE_SCALE_MAX_K_BLOCKS = 256
# Fewest stages worth keeping a pipeline running across output tiles with: enough K blocks
# in flight to cover a TMA load's latency (~1 µs) at ~0.3 µs of wgmma per K block.
_MIN_PERSISTENT_STAGES = 4
# Clusters of the dense kernel (CTAs along M, along N): none, or two CTAs along one dimension
# sharing the other operand by TMA multicast (Mosaic GPU's partitioned multicast copies and
# DeepGEMM's Hopper kernels take clusters of two).
CLUSTERS = ((1, 1), (2, 1), (1, 2))


@dataclasses.dataclass(frozen=True)
class TuningConfig:
    """Tile sizes and pipeline depth of ``blockwise_fp8_matmul``'s kernel.

    Attributes:
      block_m: rows of the CTA output tile (64, 128 or 256).
      block_n: columns of the CTA output tile: 128 or 256, or (with ``block_m = 128``
        split "m": one 64-row pass per warpgroup) 144, 160, 176 or 192.
      wg_split: how the two compute warpgroups split the CTA tile: "m" (two row slabs)
        or "n" (two column halves).
      max_concurrent_steps: pipeline stages (K blocks in flight in shared memory), before
        ``pipeline_stages`` fits them to the number of K blocks.
      grid_minor_dim: output-tile order of the persistent loop (``plgpu.planar_snake``):
        "m" walks bands of ``grid_tile_width`` tile-rows (A rows stay in L2), "n" bands of
        tile-columns.
      grid_tile_width: width of those bands, in tiles.
      scales: how the dense kernel's K loop gets the scales. "global" (default): plain
        loads from global memory (L2), one K block ahead; "smem": read from shared
        memory, A's row scales (and per-row B's column scales) staged by TMA in the
        pipeline stage of the operands, B's block scales for all of K (at most 32768)
        staged once per output tile (``tile_scale_shape``); A's scale ring costs a stage
        in most tiles (``with_scales``). "smem" is not the default yet: it has not been
        timed on a GPU, and GPU-interpret mode on CPU (jax 0.11.2) often deadlocks on it
        with the tiles split along N and the wide tiles, by how the interpreter schedules
        warpgroups (see docs/guides/kernels.md). The grouped kernels always read the
        scales from global memory.
      epilogue: how a compute warpgroup stages its output tile for the TMA stores.
        "chunks" (default): through two 8 KiB slots used in turn, waiting before each
        chunk until at most one of its stores is in flight (a tile of more than two chunks
        waits inside its own epilogue for its own stores); "tile": one slot per chunk of the
        warpgroup's tile (``output_slots``), all written, then all stored back to back, with
        the only wait at the start of the next tile's epilogue, so the stores run during
        the next tile's K loop. "tile" is what the shipped tiles use where it costs no
        pipeline stage with either output dtype (64x128, 64x256); it has not been timed
        on a GPU. The grouped kernels stage their output the same way.
      cluster: CTAs per cluster as (along M, along N): (1, 1) (default), (2, 1) (two
        neighbouring tiles of a tile-column: they share B's tile, which TMA multicasts to
        both) or (1, 2) (two tiles of a tile-row sharing A's). ``tile_cycles`` models
        them. Dense kernel only, with ``scales="global"``: a cluster barrier takes one
        arrival per warpgroup, from one thread, which does not order the other threads'
        plain reads of staged scales before the slot's release. Not timed on a GPU yet;
        in GPU-interpret mode on CPU the two-pass tiles (128x256, 256x128) in clusters
        hang at times (see docs/guides/kernels.md).
    """

    block_m: int
    block_n: int
    wg_split: Literal["m", "n"]
    max_concurrent_steps: int
    grid_minor_dim: Literal["m", "n"] = "m"
    grid_tile_width: int = 8
    scales: Literal["smem", "global"] = "global"
    epilogue: Literal["chunks", "tile"] = "chunks"
    cluster: tuple[int, int] = (1, 1)

    def __post_init__(self):
        if self.wg_split not in ("m", "n"):
            raise ValueError(f"wg_split must be 'm' or 'n', got {self.wg_split!r}.")
        if self.grid_minor_dim not in ("m", "n"):
            raise ValueError(f"grid_minor_dim must be 'm' or 'n', got {self.grid_minor_dim!r}.")
        if self.wg_m not in (64, 128):
            raise ValueError(
                f"each compute warpgroup must own 64 or 128 rows (got {self.wg_m} from "
                f"block_m={self.block_m}, wg_split={self.wg_split!r}).")
        if self.wg_n not in (64, 128, 256, *WIDE_PASSES):
            raise ValueError(
                f"each compute warpgroup must own 64, 128, 144, 160, 176, 192 or 256 columns "
                f"(got {self.wg_n} from block_n={self.block_n}, "
                f"wg_split={self.wg_split!r}).")
        if self.wg_n in WIDE_PASSES and self.wg_split != "m":
            raise ValueError(
                f"a warpgroup tile {self.wg_n} columns wide needs wg_split='m' (the CTA "
                f"tile's columns are the pass's: B's block scales are read for at most "
                f"three 128-column blocks), got {self.wg_split!r}.")
        if self.wg_n in WIDE_PASSES and self.wg_m != 64:
            raise ValueError(
                f"a warpgroup tile {self.wg_n} columns wide must have 64 rows (one pass; "
                f"got {self.wg_m}): two passes of 64x{self.wg_n} take "
                f"{self.wg_m * self.wg_n // 128 + self.wg_n // 2} f32 registers per thread of "
                f"sums and fresh accumulator, above 192.")
        if self.wg_m * self.wg_n > 2 * 64 * 128:
            raise ValueError(
                f"a {self.wg_m}x{self.wg_n} warpgroup tile needs more than two 64x128 "
                f"passes ({self.wg_m * self.wg_n // 128} f32 registers per thread of "
                f"running sums; at most 128 fit beside the fresh accumulator).")
        if not 1 <= self.max_concurrent_steps <= 16:
            raise ValueError(
                f"max_concurrent_steps must be in [1, 16], got {self.max_concurrent_steps}.")
        if self.scales not in ("smem", "global"):
            raise ValueError(f"scales must be 'smem' or 'global', got {self.scales!r}.")
        if self.epilogue not in ("chunks", "tile"):
            raise ValueError(f"epilogue must be 'chunks' or 'tile', got {self.epilogue!r}.")
        if self.grid_tile_width < 1:
            raise ValueError(f"grid_tile_width must be >= 1, got {self.grid_tile_width}.")
        if not isinstance(self.cluster, tuple) or self.cluster not in CLUSTERS:
            raise ValueError(f"cluster must be one of {CLUSTERS} (CTAs along M, along N), "
                             f"got {self.cluster!r}.")
        if self.cluster != (1, 1) and self.scales != "global":
            raise ValueError(f"cluster={self.cluster} needs scales='global', got "
                             f"{self.scales!r}.")

    @property
    def wg_m(self) -> int:
        return self.block_m // 2 if self.wg_split == "m" else self.block_m

    @property
    def wg_n(self) -> int:
        return self.block_n // 2 if self.wg_split == "n" else self.block_n

    @property
    def pass_n(self) -> int:
        """Columns of one pass (one ``wgmma`` of 64 rows): the warpgroup's width up to
        192, else 128."""
        return self.wg_n if self.wg_n <= 192 else 128

    @property
    def passes(self) -> tuple[tuple[int, int], ...]:
        """(row, column) offsets of the warpgroup's 64 x ``pass_n`` passes."""
        return tuple((r, c) for r in range(0, self.wg_m, 64)
                     for c in range(0, self.wg_n, self.pass_n))

    def __str__(self) -> str:
        cm, cn = self.cluster
        return (f"bm{self.block_m}_bn{self.block_n}_split{self.wg_split}"
                f"_s{self.max_concurrent_steps}{'_smem_scales' if self.scales == 'smem' else ''}"
                f"{'_tile_epilogue' if self.epilogue == 'tile' else ''}"
                f"{f'_cluster{cm}x{cn}' if cm * cn > 1 else ''}")


def _align(nbytes: int) -> int:
    return -(-nbytes // _SMEM_ALIGNMENT) * _SMEM_ALIGNMENT


def epilogue_n(config: TuningConfig, out_dtype) -> int:
    """Columns of one output staging slot: the widest multiple of 16 columns that divides
    the pass and takes at most 8 KiB of 64 rows (half the warpgroup's staging): 64 bf16 or
    32 f32 columns for the passes of 64 or 128 columns, fewer for the wide passes (bf16:
    144 -> 48, 160 -> 32, 176 -> 16, 192 -> 64)."""
    item = np.dtype(out_dtype).itemsize
    cap = _EPILOGUE_BYTES // 2 // (64 * item)
    return max(w for w in range(16, min(cap, config.pass_n) + 1, 16) if config.pass_n % w == 0)


def chunks_per_tile(config: TuningConfig, out_dtype) -> int:
    """Output chunks (TMA stores of 64 x ``epilogue_n``) per warpgroup and tile."""
    return len(config.passes) * (config.pass_n // epilogue_n(config, out_dtype))


def output_slots(config: TuningConfig, out_dtype) -> int:
    """Output staging slots per compute warpgroup: 2 with ``epilogue="chunks"`` (used in
    turn), ``chunks_per_tile`` with ``epilogue="tile"`` (the warpgroup's whole tile: 1 to 4
    for bf16, 2 to 8 for f32 among the shipped tiles)."""
    return chunks_per_tile(config, out_dtype) if config.epilogue == "tile" else 2


def epilogue_swizzle(config: TuningConfig, out_dtype) -> int:
    """The shared-memory swizzle (bytes) of the output staging slots: the widest of 128, 64
    and 32 bytes whose row of elements divides ``epilogue_n`` (128 for every width but the
    wide passes')."""
    item = np.dtype(out_dtype).itemsize
    epi = epilogue_n(config, out_dtype)
    return next(sw for sw in (128, 64, 32) if epi % (sw // item) == 0)


def smem_bytes(config: TuningConfig, out_dtype, stages: int | None = None,
               b_rows: bool = False, k_blocks: int = TILE_SCALE_MAX_K_BLOCKS) -> int:
    """Shared memory of one CTA as Mosaic GPU allocates it, in bytes: the pipeline ring
    (FP8 A and B tiles, and with ``config.scales == "smem"`` A's f32 row scales and, with
    ``b_rows``, B's column scales; each ring aligned to 1 KiB), with ``scales="smem"`` and B
    scaled per block the per-tile buffer of B's block scales (``tile_scale_shape``, for
    ``k_blocks`` K blocks; the default is the most this form takes) and its two barriers,
    the two warpgroups' output staging slots (``output_slots`` each, of 64 x
    ``epilogue_n``), and per stage a produced barrier and a consumed barrier per input."""
    s = config.max_concurrent_steps if stages is None else stages
    ring = _align(s * config.block_m * BLOCK_K) + _align(s * config.block_n * BLOCK_K)
    inputs = 2
    tile = 0
    if config.scales == "smem":
        a_width, b_width = scale_widths(config, b_rows)
        ring += _align(s * a_width * 4)
        inputs = 3
        if b_rows:
            ring += _align(s * b_width * 4)
            inputs = 4
        else:
            tile = _align(4 * math.prod(tile_scale_shape(config, k_blocks))) + 2 * _BARRIER_BYTES
    out = _align(2 * output_slots(config, out_dtype) * 64 * epilogue_n(config, out_dtype)
                 * np.dtype(out_dtype).itemsize)
    return ring + tile + out + (1 + inputs) * s * _BARRIER_BYTES


def tile_scale_shape(config: TuningConfig, k_blocks: int) -> tuple[int, int, int]:
    """(warpgroups, blocks, K blocks) of the f32 buffer of B's block scales staged once per
    output tile with ``scales="smem"``: per compute warpgroup, the 128-column blocks its
    passes meet (from the block of its first column: 1 for warpgroup tiles of 64 or 128
    columns, 2 for 256, 3 for the 144-192 wide passes that straddle blocks) times
    ``k_blocks`` rounded up to ``TILE_SCALE_K_ALIGN``."""
    if config.wg_n % BLOCK_K and config.wg_n > BLOCK_K:
        blocks = 3
    else:
        blocks = max(1, config.wg_n // BLOCK_K)
    return 2, blocks, -(-k_blocks // TILE_SCALE_K_ALIGN) * TILE_SCALE_K_ALIGN


def scale_widths(config: TuningConfig, b_rows: bool) -> tuple[int, int | None]:
    """f32 scales per pipeline slot, (A's, B's), with ``scales="smem"``: A's ``block_m``
    row scales and B's ``block_n`` column scales (``b_rows``) each rounded up to a multiple
    of 64 and at least 128 (the entries past the tile are never read); B's is None when B
    is scaled per block (its scales are staged once per tile, ``tile_scale_shape``, not in
    the ring). The rounding keeps every slot of a ring 256-byte aligned, above the 128
    bytes a Hopper TMA destination needs."""
    def rounded(n):
        return max(-(-n // 64) * 64, 128)

    return rounded(config.block_m), rounded(config.block_n) if b_rows else None


def max_stages(config: TuningConfig, out_dtype, limit: int = SMEM_BYTES_H200,
               b_rows: bool = False) -> int:
    """The most stages of ``config``'s tiles that fit in ``limit`` bytes."""
    s = 1
    while s < 16 and smem_bytes(config, out_dtype, s + 1, b_rows) <= limit:
        s += 1
    return s


def pipeline_stages(config: TuningConfig, k_blocks: int) -> tuple[int, bool]:
    """(stages, persistent): the pipeline depth for ``k_blocks`` K blocks, and whether one
    pipeline runs across all of a CTA's output tiles.

    ``emit_pipeline_warp_specialized`` can hand its ring from one output tile's pipeline
    to the next (``pipeline_state``) only if the stages divide the K blocks. So: the
    largest divisor of ``k_blocks`` not above ``config.max_concurrent_steps``, used across
    tiles when it is all the stages the tile can use or at least
    ``_MIN_PERSISTENT_STAGES``; otherwise every tile drains and refills a ring of
    ``min(max_concurrent_steps, k_blocks)`` stages.
    """
    cap = min(config.max_concurrent_steps, k_blocks)
    best = max(d for d in range(1, cap + 1) if k_blocks % d == 0)
    if best == cap or best >= _MIN_PERSISTENT_STAGES:
        return best, True
    return cap, False


# Shipped configs: the most stages that fit with either output dtype (``test_cross_lowering``
# checks that one more does not fit). The "chunks" epilogue stages 16 KiB per warpgroup with
# either dtype. The "tile" epilogue stages the warpgroup's tile, 8-64 KiB: the 64-row tiles
# keep their stages with it with either dtype (64x128: 16 or 32 KiB of staging for both
# warpgroups instead of 32; 64x256: 32 or 64 KiB, 4 stages of 40 KiB beside it), the others
# would lose one (128x128 with f32 output; 256x128 and 128x256 with either).
# Names are the CTA tile.
SHIPPED_CONFIGS: dict[str, TuningConfig] = {
    "128x128": TuningConfig(128, 128, "m", 6),
    "256x128": TuningConfig(256, 128, "m", 4),  # two 64-row passes per warpgroup
    "128x256": TuningConfig(128, 256, "m", 4, grid_tile_width=4),  # two 128-column passes
    "64x256": TuningConfig(64, 256, "n", 4, grid_tile_width=16, epilogue="tile"),
    "64x128": TuningConfig(64, 128, "n", 8, grid_tile_width=16, epilogue="tile"),
}

def with_scales(config: TuningConfig, scales: Literal["smem", "global"]) -> TuningConfig:
    """``config`` with the scales read as ``scales`` says and the most stages that then fit
    with either output dtype and either B scale layout, B's per-tile block scales sized for
    the longest K (``TILE_SCALE_MAX_K_BLOCKS``): the scale rings of "smem" cost a stage in
    all shipped tiles (64x256 only beside its "tile" epilogue's f32 staging); the per-tile
    buffer costs 128x256 a stage with B scaled per block (as the per-K-block window ring it
    replaced did), no other shipped tile."""
    c = dataclasses.replace(config, scales=scales)
    return dataclasses.replace(c, max_concurrent_steps=min(
        max_stages(c, dt, b_rows=br) for dt in (jnp.bfloat16, jnp.float32)
        for br in (False, True)))


# Relative cost of one output element per K block, by tile shape, measured on an H200 (the tune
# phase of tools.gpu_check, bf16 output, jax 0.11.2; docs/results/gpu.md): the throughput of
# 128x128 over each config's, averaged over 8192^3 and 4096x7168x2048 (both shapes give every
# config the same waves x tile area, so the ratio is the tile's own). 128x256: 0.96 and 0.91;
# 256x128 (which spills with either output): 1.14 and 1.11; 64x256: 1.31 and 1.20; 64x128:
# 1.52 and 1.34. Re-measure when the kernel changes.
_TILE_COST = {"128x256": 0.93, "128x128": 1.0, "256x128": 1.13, "64x256": 1.26,
              "64x128": 1.43}
_CALIBRATION_SHAPES = ((8192, 8192, 8192), (4096, 7168, 2048))
# Register spills (loaded bytes, ptxas) of the weight-gradient form (B scaled per row, f32 out)
# measured on an H200 (the GPU check's compile phase, jax 0.11.2; docs/results/gpu.md): the
# outer product of the row and column scales takes 64 more registers a thread beside two
# passes' sums, so the two-pass warpgroup tiles spill thousands of bytes.
_WGRAD_SPILL_BYTES = {"128x128": 24, "256x128": 2872, "128x256": 3808, "64x256": 24,
                      "64x128": 0}
# A config spilling at most this in the weight-gradient form is a candidate for it: 24 bytes
# is a register or two outside the K loop's steady state; the rejected ones spill > 2 KiB.
_WGRAD_MAX_SPILL_BYTES = 32
"""The shapes ``_TILE_COST`` was measured at."""

# Bandwidths of the traffic model (bytes per SM clock), the figures of DeepGEMM's Hopper
# heuristic (deepseek-ai/DeepGEMM, csrc/jit_kernels/heuristics/sm90.hpp): shared memory /
# L1 128 B per SM per clock; L2 64 B per SM per clock, at most about 8 TB/s at 1.3 GHz for
# the chip (6154 B per clock).
_L1_BYTES_PER_SM = 128
_L2_BYTES_PER_SM = 64
_L2_BYTES_CHIP = 8e6 / 1.3e3
_WGMMA_M = 64  # one wgmma covers 64 rows: a narrower tile still reads 64 rows' worth


def tile_cycles(m: int, n: int, k: int, block_m: int, block_n: int, *, out_bytes: int = 2,
                num_sms: int = 132, cluster: tuple[int, int] = (1, 1)) -> float:
    """Modelled clock cycles of an ``[m, k] x [n, k]`` GEMM on ``block_m x block_n`` output
    tiles (persistent CTAs, one per SM; ``cluster`` = (CTAs sharing B by TMA multicast along
    M, CTAs sharing A along N)).

    The model of DeepGEMM's Hopper heuristic (deepseek-ai/DeepGEMM,
    ``csrc/jit_kernels/heuristics/sm90.hpp``): tensor-core work and HBM bytes are the same for
    every tile, so only the L1 (shared memory) and L2 traffic and the wave quantization
    differ (the tiles of a cluster's dimension are rounded up to whole clusters). Per tile,
    L2 serves the A and B panels (``k * (block_m / cluster_n + block_n /
    cluster_m)`` FP8 bytes: multicast halves one) and the output; L1 holds them once as TMA
    writes them and once as wgmma reads them (at least 64 rows of A) plus the output staged
    and stored. Cycles = max(L1 bytes / L1 bandwidth, L2 bytes / L2 bandwidth) over all
    tiles, divided by the last wave's fill (``tiles / (waves * num_sms)``). A cluster with a
    single wave is not worth its synchronization: infinite cost.
    """
    cm, cn = cluster
    # A cluster's CTAs take neighbouring tiles: an odd count along its dimension leaves the
    # last cluster's second CTA a tile past the edge, which it computes and does not store.
    tiles = math.ceil(m / (block_m * cm)) * cm * math.ceil(n / (block_n * cn)) * cn
    waves = math.ceil(tiles / num_sms)
    if cm * cn > 1 and waves <= 1:
        return math.inf
    out = block_m * block_n * out_bytes
    l2 = k * (block_m / cn + block_n / cm) + out
    l1 = k * (block_m + block_n) + k * (max(_WGMMA_M, block_m) + block_n) + 2 * out
    l2_bw = min(_L2_BYTES_PER_SM * num_sms, _L2_BYTES_CHIP)
    cycles = max(l1 * tiles / (_L1_BYTES_PER_SM * num_sms), l2 * tiles / l2_bw)
    return cycles / (tiles / (waves * num_sms))


@functools.cache
def _residual(name: str) -> float:
    """The measured cost of a shipped tile (``_TILE_COST``, relative to 128x128) over what
    ``tile_cycles`` predicts for it at the shapes it was measured at: what the traffic model
    does not see (register spills, passes per warpgroup, the promotion's CUDA-core work)."""
    cfg = SHIPPED_CONFIGS[name]
    model = [tile_cycles(*s, cfg.block_m, cfg.block_n) / tile_cycles(*s, 128, 128)
             for s in _CALIBRATION_SHAPES]
    return _TILE_COST[name] / (sum(model) / len(model))


def choose_config(m: int, n: int, k: int, out_dtype=jnp.bfloat16, num_sms: int = 132,
                  b_rows: bool = False, *, clusters: bool = False) -> TuningConfig:
    """Picks a shipped config for an ``[m, k] x [n, k]`` product.

    Cost model: ``tile_cycles`` (waves of the persistent grid and L1 / L2 traffic, padding
    included: M and N are padded up to the tile) times the tile's measured residual
    (``_residual``: what the model does not see of this kernel); ties go to the earlier
    config in ``SHIPPED_CONFIGS``, then to no cluster. Only the shipped tiles are
    candidates: widths of 128 or 256 columns (the 144-192 wide tiles have no measured
    residual yet). With ``b_rows`` (B scaled per row: the weight gradient's form) only the
    tiles that do not spill in that form are (``_WGRAD_SPILL_BYTES``, measured): 128x128,
    64x256 and 64x128.

    With ``clusters``, each tile is also a candidate in two-CTA clusters sharing one operand
    by TMA multicast (``TuningConfig.cluster`` (2, 1) or (1, 2)), at the tile's residual;
    the model prices a cluster only with at least two waves. Off by default: clusters have
    not been timed on a GPU yet, so their residual (synchronization across the cluster, the
    computed tile past an odd edge) is unmeasured.

    Raises:
      ValueError: ``out_dtype`` is not bfloat16 or float32.
    """
    dt = np.dtype(out_dtype).name
    if dt not in ("bfloat16", "float32"):
        raise ValueError(f"out_dtype must be bfloat16 or float32, got {dt}.")
    out_bytes = np.dtype(out_dtype).itemsize
    best, best_cost = None, math.inf
    for name, cfg in SHIPPED_CONFIGS.items():
        if b_rows and _WGRAD_SPILL_BYTES[name] > _WGRAD_MAX_SPILL_BYTES:
            continue
        for cluster in CLUSTERS if clusters else ((1, 1),):
            cost = tile_cycles(m, n, k, cfg.block_m, cfg.block_n, out_bytes=out_bytes,
                               num_sms=num_sms, cluster=cluster) * _residual(name)
            if cost < best_cost:
                best, best_cost = dataclasses.replace(cfg, cluster=cluster), cost
    assert best is not None
    return best
