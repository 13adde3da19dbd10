"""Frozen tuning configs of the blockwise FP8 matmul kernel and the per-shape heuristic.

A config fixes the CTA output tile (``block_m x block_n``), how the two compute warpgroups
split it, the pipeline depth and the order in which the persistent programs visit output
tiles. K is always walked in 128-wide blocks: the scale granularity of DeepSeek-V3's recipe
and the K of one 128-byte-swizzled FP8 ``wgmma`` group.

Constraints (checked in ``TuningConfig.__post_init__``):

* each compute warpgroup owns a 64-row slab (one ``wgmma`` M of 64): it keeps two f32
  accumulators of ``64 x wg_n`` in registers, the fresh per-K-block product and the
  promoted running sum (2 x 64 regs/thread at ``wg_n = 128``). A 128-row or 256-column
  slab would need 256 regs/thread, past Hopper's 255 (and the 232 the warp-specialized
  pipeline leaves to compute warpgroups);
* ``wg_n`` divides 128, so one warpgroup tile reads a single B scale per K block; then
  ``block_n`` (<= 256) divides 512, so a CTA's B scales lie in one aligned group of 4, the
  block the pipeline copies per step (a TMA copy must move >= 16 bytes).

Stages are the most that fit the H200's 227 KiB of shared memory per block
(``smem_bytes`` models Mosaic GPU's allocation exactly;
``tests/pallas_kernels/test_pallas_cross_lowering.py`` lowers every shipped config and checks
the model against Mosaic's own count). With per-row B scales (the weight-gradient GEMM)
``choose_config`` trims stages to fit (``fit_to_smem``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

import jax.numpy as jnp
import numpy as np

__all__ = ["SHIPPED_CONFIGS", "TuningConfig", "choose_config", "fit_to_smem", "smem_bytes"]

BLOCK_K = 128  # DeepSeek-V3 (arXiv 2412.19437) §3.3.2: scales per 128 K, promotion N_C = 128.
SMEM_BYTES_H200 = 232448  # cudaDevAttrMaxSharedMemoryPerBlockOptin on H100/H200 (227 KiB).
_SMEM_ALIGNMENT = 1024  # Mosaic GPU aligns every shared-memory allocation to 1 KiB
_BARRIER_BYTES = 8  # one mbarrier


@dataclasses.dataclass(frozen=True)
class TuningConfig:
    """Tile sizes and pipeline depth of ``blockwise_fp8_matmul``'s kernel.

    Attributes:
      block_m: rows of the CTA output tile (64 or 128).
      block_n: columns of the CTA output tile (128 or 256).
      wg_split: how the two compute warpgroups split the CTA tile: "m" (two 64-row slabs)
        or "n" (two column halves).
      max_concurrent_steps: pipeline stages (K blocks in flight in shared memory).
      grid_minor_dim: output-tile order of the persistent loop (``plgpu.planar_snake``):
        "m" walks bands of ``grid_tile_width`` tile-rows (A rows stay in L2), "n" bands of
        tile-columns.
      grid_tile_width: width of those bands, in tiles.
    """

    block_m: int
    block_n: int
    wg_split: Literal["m", "n"]
    max_concurrent_steps: int
    grid_minor_dim: Literal["m", "n"] = "m"
    grid_tile_width: int = 8

    def __post_init__(self):
        if self.wg_split not in ("m", "n"):
            raise ValueError(f"wg_split must be 'm' or 'n', got {self.wg_split!r}.")
        if self.grid_minor_dim not in ("m", "n"):
            raise ValueError(f"grid_minor_dim must be 'm' or 'n', got {self.grid_minor_dim!r}.")
        if self.wg_m != 64:
            raise ValueError(
                f"each compute warpgroup must own 64 rows (got {self.wg_m} from "
                f"block_m={self.block_m}, wg_split={self.wg_split!r}).")
        if self.wg_n not in (64, 128):
            raise ValueError(
                f"each compute warpgroup must own 64 or 128 columns (got {self.wg_n} from "
                f"block_n={self.block_n}, wg_split={self.wg_split!r}).")
        if not 1 <= self.max_concurrent_steps <= 16:
            raise ValueError(
                f"max_concurrent_steps must be in [1, 16], got {self.max_concurrent_steps}.")
        if self.grid_tile_width < 1:
            raise ValueError(f"grid_tile_width must be >= 1, got {self.grid_tile_width}.")

    @property
    def wg_m(self) -> int:
        return self.block_m // 2 if self.wg_split == "m" else self.block_m

    @property
    def wg_n(self) -> int:
        return self.block_n // 2 if self.wg_split == "n" else self.block_n

    def __str__(self) -> str:
        return (f"bm{self.block_m}_bn{self.block_n}_split{self.wg_split}"
                f"_s{self.max_concurrent_steps}")


def _align(nbytes: int) -> int:
    return -(-nbytes // _SMEM_ALIGNMENT) * _SMEM_ALIGNMENT


def smem_bytes(config: TuningConfig, out_dtype, b_rows: bool = False) -> int:
    """Shared memory of one CTA as Mosaic GPU allocates it, in bytes: the pipeline ring
    (FP8 A and B tiles, f32 A scales, f32 B scales), the output staging buffer, each
    aligned to 1 KiB, and a produced and a consumed mbarrier per stage.

    ``b_rows``: B scaled per 1x128 tile (a row of ``block_n`` scales per stage) rather than
    per 128x128 block (a group of 4).
    """
    s = config.max_concurrent_steps
    ring = (_align(s * config.block_m * BLOCK_K) + _align(s * config.block_n * BLOCK_K)
            + _align(s * config.block_m * 4)
            + _align(s * (config.block_n if b_rows else 4) * 4))
    out = _align(2 * config.wg_m * config.wg_n * np.dtype(out_dtype).itemsize)
    return ring + out + 2 * s * _BARRIER_BYTES


def fit_to_smem(config: TuningConfig, out_dtype, b_rows: bool = False,
                limit: int = SMEM_BYTES_H200) -> TuningConfig:
    """``config`` with as many of its stages as fit in ``limit`` bytes (at least 1)."""
    stages = config.max_concurrent_steps
    while stages > 1 and smem_bytes(dataclasses.replace(config, max_concurrent_steps=stages),
                                    out_dtype, b_rows) > limit:
        stages -= 1
    return dataclasses.replace(config, max_concurrent_steps=stages)


# Shipped configs, per output dtype (an f32 output tile takes 32 KiB more staging, one stage
# less). Stage counts are the largest that cross-lower for the H200.
SHIPPED_CONFIGS: dict[tuple[str, str], TuningConfig] = {
    ("128x128", "bfloat16"): TuningConfig(128, 128, "m", 5),
    ("128x128", "float32"): TuningConfig(128, 128, "m", 4),
    ("64x256", "bfloat16"): TuningConfig(64, 256, "n", 4, grid_tile_width=16),
    ("64x256", "float32"): TuningConfig(64, 256, "n", 4, grid_tile_width=16),
    ("64x128", "bfloat16"): TuningConfig(64, 128, "n", 8, grid_tile_width=16),
    ("64x128", "float32"): TuningConfig(64, 128, "n", 7, grid_tile_width=16),
}

# Relative cost of one output element per K block, by tile shape: a 64x64 warpgroup tile
# reads its B operand twice as often per FLOP as a 64x128 one, and the 128x128 CTA shares its
# B tile between both warpgroups. Guesses to be replaced by H200 measurements.
_TILE_COST = {"128x128": 1.0, "64x256": 1.05, "64x128": 1.25}


def choose_config(m: int, n: int, k: int, out_dtype=jnp.bfloat16, num_sms: int = 132,
                  b_rows: bool = False) -> TuningConfig:
    """Picks a shipped config for an ``[m, k] x [n, k]`` product.

    Cost model: waves of the persistent grid (``ceil(tiles / num_sms)``) times the tile's
    area and relative cost, padding included (M and N are padded up to the tile). With
    per-row B scales (``b_rows``), stages are trimmed to fit (``fit_to_smem``).

    Raises:
      ValueError: ``out_dtype`` is not bfloat16 or float32.
    """
    dt = np.dtype(out_dtype).name
    if dt not in ("bfloat16", "float32"):
        raise ValueError(f"out_dtype must be bfloat16 or float32, got {dt}.")
    del k  # every config walks K the same way
    best, best_cost = None, math.inf
    for name in ("128x128", "64x256", "64x128"):
        cfg = SHIPPED_CONFIGS[(name, dt)]
        tiles = math.ceil(m / cfg.block_m) * math.ceil(n / cfg.block_n)
        waves = math.ceil(tiles / num_sms)
        cost = waves * cfg.block_m * cfg.block_n * _TILE_COST[name]
        if cost < best_cost:
            best, best_cost = cfg, cost
    assert best is not None
    return fit_to_smem(best, dt, b_rows)
