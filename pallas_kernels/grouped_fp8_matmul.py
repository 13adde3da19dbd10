"""Grouped blockwise FP8 GEMMs for Hopper (Mosaic GPU): an MoE layer's experts in FP8.

Forward and data gradient (``grouped_fp8_matmul``): tokens ``a [M, K]`` e4m3 sorted by
expert with 1x128 scales, expert weights ``b [G, N, K]`` e4m3 (each expert DeepSeek's
``[out, in]``, K-major) with 128x128 block scales, ``group_sizes [G]``:

    out[m] = a[m] · b[g(m)]ᵀ   (rows [start_g, start_g + group_sizes[g]) use expert g)
    out[m] = 0                 for rows past sum(group_sizes)  (as ``lax.ragged_dot``)

with ``blockwise_fp8_matmul``'s promotion (f32, the scales applied per 128-wide K block).
Weight gradient (``grouped_fp8_wgrad_matmul``): per expert, a contraction over its tokens,
``out[g] = A[:, tokens of g] · B[:, tokens of g]ᵀ`` ``[G, F1, F2]`` (``A = dyᵀ``,
``B = xᵀ`` give ``dw[g] = dy_gᵀ · x_g``), on the
*padded token layout*: each expert's tokens start on a 128-token block and its last block
is zero-filled, so every 1x128 scale block along the tokens belongs to one expert
(DeepGEMM's k-grouped layout). ``grouped_fp8_wgrad`` builds that layout from sorted tokens.

Kernel structure. A task table computed in XLA before the call (``group_tasks``) lists the
(expert, M tile, valid rows) of every M tile each expert touches: a tile that straddles two
experts is two tasks, each storing only its expert's rows; the rows past
``sum(group_sizes)`` form one more pseudo-expert whose tasks store zeros. At most
``cdiv(M, block_m) + G`` tasks (each boundary adds at most one), so the table's shape is
static and one compiled kernel serves any ``group_sizes``; the real count is read by the
kernel, whose persistent loop (``plgpu.nd_loop`` over a traced size, one CTA per SM) walks
only the real tasks' output tiles, task-major. The K loop and promotion are the dense
kernel's (``blockwise_fp8_matmul.tile_mainloop``: one implementation), with B read from
the ``[G, N, K]`` stack through one TMA descriptor (``b_ref.at[expert]``). Stores: a
task's valid rows of each 64-row pass go out by TMA as a log2 ladder of row counts
(64, 32, ..., 1; JAX's ``ragged_dot_mgpu`` does the same), from unswizzled staging slots
(a swizzled slot cannot be sliced at any row). The masked layout
(``grouped_fp8_matmul_masked``: a fixed capacity per expert with valid-row counts) is the
same kernel with another task table (``masked_tasks``).

The weight-gradient kernel walks (expert, F1 tile, F2 tile) tasks; each runs the shared K
loop over its expert's token blocks only (a traced pipeline length and offset) and an
expert with no tokens stores zeros.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from fmtkit.fp8 import expert_block_layout
from pallas_kernels import _backend
from pallas_kernels._backend import Impl, pl, plgpu
from pallas_kernels.blockwise_fp8_matmul import (
    blockwise_fp8_matmul_reference,
    pipeline_allocations,
    run_tiles_persistent,
    store_passes,
    tile_mainloop,
    wg_origin,
)
from pallas_kernels.config import (
    BLOCK_K,
    SHIPPED_CONFIGS,
    TuningConfig,
    choose_config,
    chunks_per_tile,
    epilogue_n,
    output_slots,
    pipeline_stages,
)
from pallas_kernels.quantize import quantize_1x128

__all__ = [
    "choose_grouped_config",
    "group_tasks",
    "grouped_fp8_dgrad",
    "grouped_fp8_matmul",
    "grouped_fp8_matmul_masked",
    "grouped_fp8_matmul_masked_reference",
    "grouped_fp8_matmul_reference",
    "grouped_fp8_wgrad",
    "grouped_fp8_wgrad_matmul",
    "grouped_fp8_wgrad_matmul_reference",
    "masked_tasks",
    "padded_token_layout",
]

_FP8 = jnp.dtype(jnp.float8_e4m3fn)
_OUT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))
KERNEL_NAME = "grouped_fp8_matmul"
WGRAD_KERNEL_NAME = "grouped_fp8_wgrad"
# Row counts of the store ladder: any 0..64 valid rows of a 64-row pass as at most one
# TMA store of each size.
_LADDER = (64, 32, 16, 8, 4, 2, 1)

_FAULT: str | None = None
"""Private fault injection for the negative controls (``tests/pallas_kernels``):
"wrong_offset" assigns the first task of each expert to the expert before it (an
off-by-one group offset), "drop_tail" leaves the last real task out of the count. Never
set outside tests."""
_FAULTS = ("wrong_offset", "drop_tail")


# --------------------------------------------------------------------------------------
# Task table (XLA, before the call).


def _interval_tasks(starts, ends, groups, m: int, block_m: int, t_max: int):
    """Tasks of consecutive row intervals ``[starts[i], ends[i])`` (covering ``[0, m)`` in
    order; empty ones allowed) of group ``groups[i]``: one task per ``block_m`` tile an
    interval touches, in row order; ``t_max`` bounds their count."""
    first = starts // block_m
    ntiles = jnp.where(ends > starts, (ends - 1) // block_m - first + 1, 0)
    cum = jnp.cumsum(ntiles)
    begin = cum - ntiles
    t = jnp.arange(t_max, dtype=jnp.int32)
    if _FAULT == "wrong_offset":
        iv = jnp.sum(t[:, None] > cum[None, :], axis=1)
    else:
        iv = jnp.sum(t[:, None] >= cum[None, :], axis=1)
    iv = jnp.minimum(iv, starts.shape[0] - 1)
    tile = first[iv] + t - begin[iv]
    lo = jnp.maximum(starts[iv], tile * block_m)
    hi = jnp.minimum(ends[iv], tile * block_m + block_m)
    n_real = cum[-1]
    if _FAULT == "drop_tail":
        n_real = n_real - 1
    real = t < n_real
    tasks = jnp.stack([jnp.where(real, v, 0) for v in (groups[iv], tile, lo, hi)])
    return tasks.astype(jnp.int32), n_real.reshape(1).astype(jnp.int32)


def group_tasks(group_sizes: jax.Array, m: int, block_m: int) -> tuple[jax.Array, jax.Array]:
    """The grouped kernel's task table for ``m`` sorted rows in tiles of ``block_m``.

    Groups are laid out in order from row 0 (``start_g = sum(group_sizes[:g])``, clamped to
    ``m``); one pseudo-group ``G`` covers the rows past the last group (its tasks store
    zeros). Each (pseudo-)group with rows contributes one task per ``block_m`` tile it
    touches, in row order, so the tasks of all groups number at most
    ``cdiv(m, block_m) + G`` (a tile is shared only at one of the G boundaries).

    Returns:
      ``tasks`` int32 ``[4, cdiv(m, block_m) + G]``: per task its group (``G``: zeros),
      its M tile, and its first and one-past-last rows (absolute); tasks past the real
      count hold zeros. ``n_real`` int32 ``[1]``: the real count.
    """
    ng = group_sizes.shape[0]
    sizes = jnp.maximum(group_sizes.astype(jnp.int32), 0)
    ends = jnp.minimum(jnp.cumsum(sizes), m)
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    starts = jnp.concatenate([starts, ends[-1:]])  # + the pseudo-group of the tail rows
    ends = jnp.concatenate([ends, jnp.full((1,), m, jnp.int32)])
    groups = jnp.arange(ng + 1, dtype=jnp.int32)
    return _interval_tasks(starts, ends, groups, m, block_m, pl.cdiv(m, block_m) + ng)


def masked_tasks(counts: jax.Array, capacity: int, block_m: int
                 ) -> tuple[jax.Array, jax.Array]:
    """The task table of the masked layout: expert g owns rows ``[g * capacity,
    g * capacity + counts[g])`` of ``G * capacity`` (``counts`` clamped to
    ``[0, capacity]``); the rest of its slots form zero (pseudo-group ``G``) intervals.
    At most ``cdiv(G * capacity, block_m) + 2G`` tasks; same format as ``group_tasks``."""
    ng = counts.shape[0]
    m = ng * capacity
    cnt = jnp.clip(counts.astype(jnp.int32), 0, capacity)
    base = jnp.arange(ng, dtype=jnp.int32) * capacity
    starts = jnp.stack([base, base + cnt], axis=1).reshape(-1)
    ends = jnp.stack([base + cnt, base + capacity], axis=1).reshape(-1)
    groups = jnp.stack([jnp.arange(ng, dtype=jnp.int32), jnp.full((ng,), ng, jnp.int32)],
                       axis=1).reshape(-1)
    return _interval_tasks(starts, ends, groups, m, block_m, pl.cdiv(m, block_m) + 2 * ng)


def padded_token_layout(group_sizes: jax.Array, m: int) -> tuple[jax.Array, jax.Array, int]:
    """The weight gradient's padded token layout for ``m`` sorted tokens in 128-token
    blocks: ``fmtkit.fp8.expert_block_layout(group_sizes, m, 128)`` (``dest`` [m],
    ``group_blocks`` [2, G], the static padded length ``tp``), the layout
    ``fmtkit.fp8.ragged_dot`` builds before it calls the kernel."""
    return expert_block_layout(group_sizes, m, BLOCK_K)


# --------------------------------------------------------------------------------------
# Kernels (refs).


def _store_rows(sums, out_ref, my_smem, *, config: TuningConfig, row0, col0, lo, hi, zero,
                chunk):
    """Stores rows ``[lo, hi)`` (absolute) of a warpgroup's sums (zeros if ``zero``):
    each 64-row pass's valid rows as a ladder of TMA stores of 64, 32, ..., 1 rows, one
    bulk group per staging chunk (see ``store_passes`` for the slots' protocol: with
    ``config.epilogue == "tile"`` one wait for all earlier stores, then chunk i in slot
    i)."""
    out_dtype = out_ref.dtype
    epi_n = epilogue_n(config, out_dtype)
    tile = config.epilogue == "tile"
    if tile:
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    i = 0
    for (pr, pc), acc in zip(config.passes, sums):
        prow = row0 + pr
        start = jnp.clip(lo - prow, 0, 64)
        size = jnp.maximum(jnp.clip(hi - prow, 0, 64) - start, 0)
        for e in range(0, config.pass_n, epi_n):
            _store_chunk(acc[:, e:e + epi_n], my_smem.at[i if tile else lax.rem(chunk, 2)],
                         out_ref.at[:, pl.ds(col0 + pc + e, epi_n)], prow, start, size, zero,
                         wait=not tile)
            chunk, i = chunk + 1, i + 1


def _store_chunk(value, slot_ref, out_cols, prow, start, size, zero, *, wait: bool = True):
    """One staging chunk: waits for the slot (``wait``), writes ``value`` (or zeros), then
    stores its rows ``[start, start + size)`` to ``out_cols`` rows from ``prow + start`` by
    a ladder of TMA stores, committed as one bulk group."""
    if wait:
        plgpu.wait_smem_to_gmem(1, wait_read_only=True)

    @pl.when(zero)
    def _zeros():
        slot_ref[...] = jnp.zeros(value.shape, slot_ref.dtype)

    @pl.when(~zero)
    def _value():
        slot_ref[...] = value.astype(slot_ref.dtype)

    plgpu.commit_smem()
    off = start
    for rows in _LADDER:
        pl.when(size & rows != 0)(functools.partial(
            plgpu.copy_smem_to_gmem, slot_ref.at[pl.ds(off, rows)],
            out_cols.at[pl.ds(prow + off, rows)], commit_group=False))
        off = off + (size & rows)
    plgpu.commit_smem_to_gmem_group()


def _grouped_kernel(tasks_ref, nreal_ref, a_ref, as_ref, b_ref, bs_ref, out_ref, *,
                    config: TuningConfig, n_tiles: int, k_blocks: int, stages: int,
                    persistent: bool, num_groups: int):
    """One persistent CTA of the grouped GEMM: ``tasks_ref`` int32 [4, T] and
    ``nreal_ref`` [1] (``group_tasks``), ``a_ref`` [Mp, K] e4m3, ``as_ref`` [K/128, Mp]
    f32, ``b_ref`` [G, N, K] e4m3, ``bs_ref`` [G, K/128, ceil(Np/128)] f32 (transposed
    per expert), ``out_ref`` [Mp, N]. The pipeline protocol is ``_matmul_kernel``'s."""
    bm, bn = config.block_m, config.block_n
    out_dtype = out_ref.dtype
    epi_n = epilogue_n(config, out_dtype)
    per_tile = chunks_per_tile(config, out_dtype)

    @functools.partial(
        pl.run_scoped,
        allocs=pipeline_allocations(a_ref, b_ref.at[0], config=config, k_blocks=k_blocks,
                                    stages=stages),
        # [warpgroup, slot], unswizzled: the ladder slices them at any row.
        out_smem=plgpu.SMEM((2, output_slots(config, out_dtype), 64, epi_n), out_dtype),
        collective_axes="wg",
    )
    def _scope(allocs, out_smem):
        wg = lax.axis_index("wg")
        my_smem = out_smem.at[wg]
        n_real = nreal_ref[0]

        @plgpu.nd_loop((n_real * n_tiles,), collective_axes="sm")
        def _tile(info):
            (lin,) = info.index
            task, ni = lax.div(lin, n_tiles), lax.rem(lin, n_tiles)
            grp, tile = tasks_ref[0, task], tasks_ref[1, task]
            lo, hi = tasks_ref[2, task], tasks_ref[3, task]
            expert = jnp.minimum(grp, num_groups - 1)  # the tail's tasks compute any expert
            r0, c0 = wg_origin(config, wg)
            row0, col0 = tile * bm + r0, ni * bn + c0

            def epilogue(sums):
                _store_rows(sums, out_ref, my_smem, config=config, row0=row0, col0=col0,
                            lo=lo, hi=hi, zero=grp == num_groups,
                            chunk=info.local_index * per_tile)

            def run(state):
                tile_mainloop(a_ref.at[pl.ds(tile * bm, bm), :],
                              b_ref.at[expert, pl.ds(ni * bn, bn), :], as_ref,
                              bs_ref.at[expert], allocs=allocs, config=config,
                              k_blocks=k_blocks, b_rows=False, stages=stages, r0=r0, c0=c0,
                              row0=row0, col0=col0, epilogue=epilogue, state=state)

            run_tiles_persistent(run, info.local_index == 0,
                                 info.local_index == info.num_local_steps - 1, persistent)

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _wgrad_kernel(blocks_ref, a_ref, as_ref, b_ref, bs_ref, out_ref, *, config: TuningConfig,
                  m_tiles: int, n_tiles: int, num_groups: int, stages: int,
                  max_blocks: int):
    """One persistent CTA of the grouped weight gradient: ``blocks_ref`` int32 [2, G]
    (``padded_token_layout``), ``a_ref`` [F1p, Tp] e4m3, ``as_ref`` [Tp/128, F1p] f32,
    ``b_ref`` [F2, Tp] e4m3, ``bs_ref`` [Tp/128, F2p] f32 (per row), ``out_ref``
    [G, F1p, F2]. Each tile runs its own pipeline over its expert's token blocks."""
    bm, bn = config.block_m, config.block_n
    out_dtype = out_ref.dtype
    epi_n = epilogue_n(config, out_dtype)
    per_tile = chunks_per_tile(config, out_dtype)

    @functools.partial(
        pl.run_scoped,
        allocs=pipeline_allocations(a_ref, b_ref, config=config, k_blocks=max_blocks,
                                    stages=stages),
        out_smem=plgpu.SMEM((2, output_slots(config, out_dtype), 64, epi_n), out_dtype,
                            transforms=(plgpu.TilingTransform((8, 1024 // (
                                jnp.dtype(out_dtype).itemsize * 8))),
                                        plgpu.SwizzleTransform(128))),
        collective_axes="wg",
    )
    def _scope(allocs, out_smem):
        wg = lax.axis_index("wg")
        my_smem = out_smem.at[wg]

        @plgpu.nd_loop((num_groups * m_tiles * n_tiles,), collective_axes="sm")
        def _tile(info):
            (lin,) = info.index
            g = lax.div(lin, m_tiles * n_tiles)
            rest = lax.rem(lin, m_tiles * n_tiles)
            mi, ni = lax.div(rest, n_tiles), lax.rem(rest, n_tiles)
            blk0, nblk = blocks_ref[0, g], blocks_ref[1, g]
            r0, c0 = wg_origin(config, wg)
            row0, col0 = mi * bm + r0, ni * bn + c0
            out_g = out_ref.at[g]
            chunk = info.local_index * per_tile

            def epilogue(sums):
                store_passes(sums, out_g, my_smem, config=config, row0=row0, col0=col0,
                             chunk=chunk)

            @pl.when(nblk > 0)
            def _():
                tile_mainloop(a_ref.at[pl.ds(mi * bm, bm), :], b_ref.at[pl.ds(ni * bn, bn), :],
                              as_ref, bs_ref, allocs=allocs, config=config, k_blocks=nblk,
                              b_rows=True, stages=stages, r0=r0, c0=c0, row0=row0,
                              col0=col0, epilogue=epilogue, k_offset=blk0)

            # An expert without tokens: a zero gradient, stored by the compute warpgroups
            # (outside a pipeline all three warpgroups run; the TMA one is wg 2).
            @pl.when((nblk == 0) & (wg < 2))
            def _():
                epilogue(tuple(plgpu.layout_cast(jnp.zeros((64, config.pass_n), jnp.float32),
                                                 plgpu.Layout.WGMMA)
                               for _ in config.passes))

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def kernel_name(config: TuningConfig, out_dtype, wgrad: bool = False) -> str:
    """The compiled kernel's name, unique per variant."""
    base = WGRAD_KERNEL_NAME if wgrad else KERNEL_NAME
    return f"{base}_{config}_{jnp.dtype(out_dtype).name}"


# --------------------------------------------------------------------------------------
# Validation.


def _check_fp8(**arrays):
    for name, x in arrays.items():
        if not hasattr(x, "dtype") or jnp.dtype(x.dtype) != _FP8:
            dt = getattr(x, "dtype", type(x).__name__)
            raise TypeError(f"{name} must be a float8_e4m3fn array, got dtype {dt}.")


def _check_f32(**arrays):
    for name, x in arrays.items():
        if not hasattr(x, "dtype") or jnp.dtype(x.dtype) != jnp.float32:
            dt = getattr(x, "dtype", type(x).__name__)
            raise TypeError(f"{name} must be a float32 array, got dtype {dt}.")


def _check_out(out_dtype) -> jnp.dtype:
    out_dtype = jnp.dtype(out_dtype)
    if out_dtype not in _OUT_DTYPES:
        raise ValueError(f"out_dtype must be bfloat16 or float32, got {out_dtype}.")
    return out_dtype


def _check_sizes(group_sizes, g: int, name: str = "group_sizes"):
    dt = getattr(group_sizes, "dtype", None)
    if dt is None or not jnp.issubdtype(dt, jnp.integer):
        raise TypeError(f"{name} must be an integer array, got "
                        f"{getattr(dt, 'name', type(group_sizes).__name__)}.")
    if tuple(group_sizes.shape) != (g,):
        raise ValueError(f"{name} must have shape ({g},), one entry per expert, got "
                         f"{tuple(group_sizes.shape)}.")


def _check_grouped(a, a_scale, b, b_scale, group_sizes, out_dtype):
    _check_fp8(a=a, b=b)
    _check_f32(a_scale=a_scale, b_scale=b_scale)
    out_dtype = _check_out(out_dtype)
    if a.ndim != 2:
        raise ValueError(f"a must be 2-D [M, K] (tokens sorted by expert), got {a.shape}.")
    if b.ndim != 3:
        raise ValueError(f"b must be 3-D [G, N, K] (one [N, K] weight per expert), got "
                         f"{b.shape}.")
    m, k = a.shape
    g, n, kb_ = b.shape
    if kb_ != k:
        raise ValueError(f"a.shape[1]={k} must equal K={kb_} from b.shape={b.shape}.")
    if k % BLOCK_K:
        raise ValueError(f"k={k} must be divisible by block_k={BLOCK_K}.")
    if tuple(a_scale.shape) != (m, k // BLOCK_K):
        raise ValueError(f"a_scale must have shape {(m, k // BLOCK_K)} (one scale per "
                         f"1x{BLOCK_K} tile of a), got {a_scale.shape}.")
    want = (g, pl.cdiv(n, BLOCK_K), k // BLOCK_K)
    if tuple(b_scale.shape) != want:
        raise ValueError(f"b_scale must have shape {want} (one scale per {BLOCK_K}x"
                         f"{BLOCK_K} block of each expert), got {b_scale.shape}.")
    _check_sizes(group_sizes, g)
    return out_dtype


def choose_grouped_config(m: int, n: int, k: int, groups: int, out_dtype=jnp.bfloat16,
                          num_sms: int = 132) -> TuningConfig:
    """A shipped config for a grouped GEMM of ``m`` rows in ``groups`` experts.

    The dense heuristic (``choose_config``) on the rows the kernel computes: each expert
    boundary inside a tile makes that tile run twice, half a 128-row tile per expert on
    average, so ``m + 64 * groups`` rows. When the experts average fewer than 128 rows
    (decode, many small experts), a 128- or 256-row tile would be mostly boundary: the
    64-row config of the same width is taken instead.
    """
    cfg = choose_config(m + 64 * groups, n, k, out_dtype, num_sms)
    if m < 128 * groups and cfg.block_m > 64:
        cfg = next((c for c in SHIPPED_CONFIGS.values()
                    if c.block_m == 64 and c.block_n == cfg.block_n),
                   SHIPPED_CONFIGS["64x128"])
    return cfg


def _config(config, m, n, k, out_dtype, groups=None):
    if config is None:
        if groups is None:
            return choose_config(m, n, k, out_dtype, _backend.num_sms("kernel"))
        return choose_grouped_config(m, n, k, groups, out_dtype, _backend.num_sms("kernel"))
    if not isinstance(config, TuningConfig):
        raise TypeError(f"config must be a TuningConfig or None, got {type(config).__name__}.")
    if config.cluster != (1, 1):
        raise ValueError(f"config.cluster must be (1, 1) in the grouped kernels (clusters are "
                         f"the dense kernel's), got {config.cluster}.")
    return config


# --------------------------------------------------------------------------------------
# Public API: forward and data gradient.


@functools.partial(jax.jit, static_argnames=("out_dtype",))
def grouped_fp8_matmul_reference(
    a: jax.Array, a_scale: jax.Array, b: jax.Array, b_scale: jax.Array,
    group_sizes: jax.Array, *, out_dtype: jax.typing.DTypeLike = jnp.bfloat16,
) -> jax.Array:
    """Pure-JAX semantics of ``grouped_fp8_matmul``: each row's product with its expert by
    ``blockwise_fp8_matmul_reference`` (the same per-K-block promotion in f32), zeros past
    ``sum(group_sizes)``, rounded once to ``out_dtype``. Computes every expert for every
    row (G times the FLOPs): a definition, not a fast path.

    Example:
      >>> a = jnp.ones((4, 128), jnp.float8_e4m3fn)
      >>> b = jnp.stack([jnp.ones((8, 128)), 2 * jnp.ones((8, 128))]).astype(a.dtype)
      >>> out = grouped_fp8_matmul_reference(a, jnp.ones((4, 1)), b, jnp.ones((2, 1, 1)),
      ...                                    jnp.array([1, 2]), out_dtype=jnp.float32)
      >>> [float(v) for v in out[:, 0]]
      [128.0, 256.0, 256.0, 0.0]
    """
    out_dtype = _check_grouped(a, a_scale, b, b_scale, group_sizes, out_dtype)
    m, g = a.shape[0], b.shape[0]
    per_expert = jax.vmap(lambda bv, bs: blockwise_fp8_matmul_reference(
        a, a_scale, bv, bs, out_dtype=jnp.float32))(b, b_scale)  # [G, M, N]
    ends = jnp.cumsum(jnp.maximum(group_sizes.astype(jnp.int32), 0))
    gid = jnp.sum(jnp.arange(m, dtype=jnp.int32)[:, None] >= ends[None, :], axis=1)
    rows = jnp.take_along_axis(per_expert, jnp.minimum(gid, g - 1)[None, :, None], axis=0)[0]
    return jnp.where((gid < g)[:, None], rows, 0.0).astype(out_dtype)


@functools.partial(jax.jit, static_argnames=("out_dtype", "impl", "config"))
def grouped_fp8_matmul(
    a: jax.Array, a_scale: jax.Array, b: jax.Array, b_scale: jax.Array,
    group_sizes: jax.Array, *, out_dtype: jax.typing.DTypeLike = jnp.bfloat16,
    impl: Impl = "auto", config: TuningConfig | None = None,
) -> jax.Array:
    """Grouped blockwise-scaled FP8 GEMM: row m of ``a`` times its expert's ``b[g]ᵀ``.

    Args:
      a: float8_e4m3fn ``[M, K]``, tokens sorted by expert.
      a_scale: float32 ``[M, K/128]``, one scale per 1x128 tile of ``a``.
      b: float8_e4m3fn ``[G, N, K]``, each expert's weight K-major (DeepSeek's
        ``[out, in]``; FP8 ``wgmma`` reads only K-major operands).
      b_scale: float32 ``[G, ceil(N/128), K/128]``, one scale per 128x128 block.
      group_sizes: int ``[G]``: rows ``[start_g, start_g + group_sizes[g])`` use expert g;
        zero allowed, ``sum <= M`` (rows past the sum are zeros).
      out_dtype: bfloat16 (default) or float32.
      impl: as ``blockwise_fp8_matmul``.
      config: a ``TuningConfig``; default ``choose_grouped_config(M, N, K, G, out_dtype)``.

    Returns:
      ``[M, N]`` of ``out_dtype``.

    Raises:
      TypeError: a or b not float8_e4m3fn, a scale not float32, ``group_sizes`` not
        integer.
      ValueError: mismatched or unaligned shapes, an unsupported ``out_dtype`` or ``impl``.

    ``group_sizes`` is data: one compiled kernel serves every layout. M is zero-padded to
    the tile (a copy of ``a``; choose M a multiple of ``block_m`` to avoid it).

    Example:
      >>> from pallas_kernels import quantize_1x128, quantize_128x128
      >>> xq, xs = quantize_1x128(jnp.ones((256, 512)))
      >>> wq, ws = jax.vmap(quantize_128x128)(jnp.ones((2, 384, 512)))
      >>> y = grouped_fp8_matmul(xq, xs, wq, ws, jnp.array([100, 156]))  # [256, 384] bf16
    """
    out_dtype = _check_grouped(a, a_scale, b, b_scale, group_sizes, out_dtype)
    kind = _backend.resolve_impl(impl)
    if kind == "reference":
        return grouped_fp8_matmul_reference(a, a_scale, b, b_scale, group_sizes,
                                            out_dtype=out_dtype)
    m, k = a.shape
    g, n, _ = b.shape
    config = _config(config, m, n, k, out_dtype, g)
    bm = config.block_m
    mp = pl.cdiv(m, bm) * bm
    if mp != m:  # zero rows: their products are zero, any finite scale will do
        a = jnp.pad(a, ((0, mp - m), (0, 0)))
        a_scale = jnp.pad(a_scale, ((0, mp - m), (0, 0)), constant_values=1.0)
    tasks, n_real = group_tasks(group_sizes, mp, bm)
    out = _grouped_call(tasks, n_real, a, a_scale, b, b_scale, config=config,
                        out_dtype=out_dtype, impl=impl)
    return out[:m] if mp != m else out


def _grouped_call(tasks, n_real, a, a_scale, b, b_scale, *, config: TuningConfig, out_dtype,
                  impl: Impl):
    """The grouped kernel on ``a`` [Mp, K] (Mp a multiple of ``block_m``) with a task
    table: ``[Mp, N]``, rows outside every task untouched."""
    mp, k = a.shape
    g, n, _ = b.shape
    bn = config.block_n
    n_tiles, k_blocks = pl.cdiv(n, bn), k // BLOCK_K
    width = pl.cdiv(n_tiles * bn, BLOCK_K)
    # Per expert, the scales transposed: one contiguous row per K block (padding scales are
    # 1; they only meet the zeros TMA loads past N).
    bs_t = jnp.pad(jnp.swapaxes(b_scale, 1, 2),
                   ((0, 0), (0, 0), (0, width - b_scale.shape[1])), constant_values=1.0)
    stages, persistent = pipeline_stages(config, k_blocks)
    kernel = plgpu.kernel(
        functools.partial(_grouped_kernel, config=config, n_tiles=n_tiles,
                          k_blocks=k_blocks, stages=stages, persistent=persistent,
                          num_groups=g),
        out_type=jax.ShapeDtypeStruct((mp, n), out_dtype),
        grid=(_backend.num_sms(impl),),
        grid_names=("sm",),
        num_threads=3,
        thread_name="wg",
        interpret=_backend.interpret_params(impl),
        kernel_name=kernel_name(config, out_dtype),
    )
    return kernel(tasks, n_real, a, a_scale.T, b, bs_t)


@functools.partial(jax.jit, static_argnames=("out_dtype",))
def grouped_fp8_matmul_masked_reference(
    a: jax.Array, a_scale: jax.Array, b: jax.Array, b_scale: jax.Array, counts: jax.Array,
    *, out_dtype: jax.typing.DTypeLike = jnp.bfloat16,
) -> jax.Array:
    """Pure-JAX semantics of ``grouped_fp8_matmul_masked``: expert g's first ``counts[g]``
    rows times ``b[g]ᵀ`` by ``blockwise_fp8_matmul_reference``, zeros after.

    Example:
      >>> a = jnp.ones((2, 3, 128), jnp.float8_e4m3fn)
      >>> b = jnp.ones((2, 8, 128), jnp.float8_e4m3fn)
      >>> out = grouped_fp8_matmul_masked_reference(a, jnp.ones((2, 3, 1)), b,
      ...     jnp.ones((2, 1, 1)), jnp.array([1, 3]), out_dtype=jnp.float32)
      >>> out[:, :, 0].tolist()
      [[128.0, 0.0, 0.0], [128.0, 128.0, 128.0]]
    """
    out_dtype = _check_masked(a, a_scale, b, b_scale, counts, out_dtype)
    cap = a.shape[1]
    per = jax.vmap(lambda x, xs, w, ws: blockwise_fp8_matmul_reference(
        x, xs, w, ws, out_dtype=jnp.float32))(a, a_scale, b, b_scale)
    keep = jnp.arange(cap)[None, :] < jnp.clip(counts, 0, cap)[:, None]
    return jnp.where(keep[:, :, None], per, 0.0).astype(out_dtype)


def _check_masked(a, a_scale, b, b_scale, counts, out_dtype):
    if not hasattr(a, "ndim") or a.ndim != 3:
        raise ValueError(f"a must be 3-D [G, capacity, K] (each expert's slots), got "
                         f"{getattr(a, 'shape', type(a).__name__)}.")
    if not hasattr(a_scale, "ndim") or a_scale.ndim != 3:
        raise ValueError(f"a_scale must be 3-D [G, capacity, K/128], got "
                         f"{getattr(a_scale, 'shape', type(a_scale).__name__)}.")
    g, cap, k = a.shape
    out_dtype = _check_grouped(a.reshape(g * cap, k), a_scale.reshape(g * cap, -1), b,
                               b_scale, counts, out_dtype)
    if b.shape[0] != g:
        raise ValueError(f"b must hold one expert per slot group: b.shape[0]={b.shape[0]}, "
                         f"a.shape[0]={g}.")
    return out_dtype


@functools.partial(jax.jit, static_argnames=("out_dtype", "impl", "config"))
def grouped_fp8_matmul_masked(
    a: jax.Array, a_scale: jax.Array, b: jax.Array, b_scale: jax.Array, counts: jax.Array,
    *, out_dtype: jax.typing.DTypeLike = jnp.bfloat16, impl: Impl = "auto",
    config: TuningConfig | None = None,
) -> jax.Array:
    """Masked grouped GEMM (a fixed capacity per expert; decode and capacity-factor MoE):
    ``out[g, r] = a[g, r] · b[g]ᵀ`` for ``r < counts[g]``, zeros for the other slots.

    The same kernel as ``grouped_fp8_matmul`` on ``a`` viewed as ``[G * capacity, K]``
    with the task table of ``masked_tasks``: each expert's valid rows, and zero tasks for
    its empty slots; no token sort. ``counts`` is data (one compiled kernel).

    Args:
      a: float8_e4m3fn ``[G, capacity, K]``.
      a_scale: float32 ``[G, capacity, K/128]``.
      b: as ``grouped_fp8_matmul``.
      b_scale: as ``grouped_fp8_matmul``.
      counts: int ``[G]``, the valid rows of each expert (clamped to ``[0, capacity]``).
      out_dtype: as ``grouped_fp8_matmul``.
      impl: as ``grouped_fp8_matmul``.
      config: as ``grouped_fp8_matmul``.

    Returns:
      ``[G, capacity, N]`` of ``out_dtype``.
    """
    out_dtype = _check_masked(a, a_scale, b, b_scale, counts, out_dtype)
    if _backend.resolve_impl(impl) == "reference":
        return grouped_fp8_matmul_masked_reference(a, a_scale, b, b_scale, counts,
                                                   out_dtype=out_dtype)
    g, cap, k = a.shape
    n = b.shape[1]
    config = _config(config, g * cap, n, k, out_dtype, g)
    bm = config.block_m
    a2, as2 = a.reshape(g * cap, k), a_scale.reshape(g * cap, k // BLOCK_K)
    m = g * cap
    mp = pl.cdiv(m, bm) * bm
    if mp != m:
        a2 = jnp.pad(a2, ((0, mp - m), (0, 0)))
        as2 = jnp.pad(as2, ((0, mp - m), (0, 0)), constant_values=1.0)
    tasks, n_real = masked_tasks(counts, cap, bm)
    out = _grouped_call(tasks, n_real, a2, as2, b, b_scale, config=config,
                        out_dtype=out_dtype, impl=impl)
    return out[:m].reshape(g, cap, n)


@functools.partial(jax.jit, static_argnames=("out_dtype", "impl", "config"))
def grouped_fp8_dgrad(
    dy: jax.Array, w: jax.Array, w_scale: jax.Array, group_sizes: jax.Array, *,
    out_dtype: jax.typing.DTypeLike = jnp.bfloat16, impl: Impl = "auto",
    config: TuningConfig | None = None,
) -> jax.Array:
    """Data gradient ``dx[m] = dy[m] · w[g(m)]`` of ``y[m] = x[m] · w[g(m)]ᵀ``: the same
    kernel on ``dy`` quantized 1x128 along N and the transposed expert blocks (128x128
    blocks transpose with their scales; the transpose is one copy of the FP8 stack):

        dy_q, dy_s = quantize_1x128(dy)
        dx = grouped_fp8_matmul(dy_q, dy_s, swapaxes(w, 1, 2), swapaxes(w_scale, 1, 2), ...)

    Args:
      dy: floating ``[M, N]``; N divisible by 128 (the contraction).
      w: float8_e4m3fn ``[G, N, K]``, the forward's quantized experts.
      w_scale: float32 ``[G, N/128, K/128]``.
      group_sizes: as ``grouped_fp8_matmul``.
      out_dtype: as ``grouped_fp8_matmul``.
      impl: as ``grouped_fp8_matmul``.
      config: as ``grouped_fp8_matmul``.

    Returns:
      ``dx``, ``[M, K]`` of ``out_dtype`` (zeros past ``sum(group_sizes)``).

    Raises:
      ValueError: w not 3-D or N not divisible by 128; and as ``grouped_fp8_matmul``.
    """
    if not hasattr(w, "shape") or w.ndim != 3:
        raise ValueError(f"w must be 3-D [G, N, K], got {getattr(w, 'shape', type(w))}.")
    if w.shape[1] % BLOCK_K:
        raise ValueError(f"n={w.shape[1]} (w.shape[1], the contraction dim of dgrad) must be "
                         f"divisible by block_k={BLOCK_K}.")
    dy_q, dy_s = quantize_1x128(dy, impl=impl)
    return grouped_fp8_matmul(dy_q, dy_s, jnp.swapaxes(w, 1, 2), jnp.swapaxes(w_scale, 1, 2),
                              group_sizes, out_dtype=out_dtype, impl=impl, config=config)


# --------------------------------------------------------------------------------------
# Public API: weight gradient.


def _check_wgrad(a, a_scale, b, b_scale, group_blocks, out_dtype):
    _check_fp8(a=a, b=b)
    _check_f32(a_scale=a_scale, b_scale=b_scale)
    out_dtype = _check_out(out_dtype)
    for name, x in (("a", a), ("b", b)):
        if x.ndim != 2:
            raise ValueError(f"{name} must be 2-D [F, T] (tokens minor), got {x.shape}.")
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"a.shape[1]={a.shape[1]} and b.shape[1]={b.shape[1]} (tokens) "
                         f"must match.")
    t = a.shape[1]
    if t % BLOCK_K:
        raise ValueError(f"tokens={t} must be divisible by block_k={BLOCK_K} (the padded "
                         f"token layout).")
    for name, x, s in (("a_scale", a_scale, a), ("b_scale", b_scale, b)):
        if tuple(x.shape) != (s.shape[0], t // BLOCK_K):
            raise ValueError(f"{name} must have shape {(s.shape[0], t // BLOCK_K)} (one "
                             f"scale per 1x{BLOCK_K} tile along the tokens), got {x.shape}.")
    dt = getattr(group_blocks, "dtype", None)
    if dt is None or not jnp.issubdtype(dt, jnp.integer) or group_blocks.ndim != 2 or (
            group_blocks.shape[0] != 2):
        raise ValueError("group_blocks must be an integer [2, G] array (each expert's first "
                         "128-token block and block count), got "
                         f"{getattr(group_blocks, 'shape', type(group_blocks).__name__)}.")
    return out_dtype


@functools.partial(jax.jit, static_argnames=("out_dtype",))
def grouped_fp8_wgrad_matmul_reference(
    a: jax.Array, a_scale: jax.Array, b: jax.Array, b_scale: jax.Array,
    group_blocks: jax.Array, *, out_dtype: jax.typing.DTypeLike = jnp.float32,
) -> jax.Array:
    """Pure-JAX semantics of ``grouped_fp8_wgrad_matmul``: per expert, the dense
    reference over its token blocks only (the other blocks masked to zero: exact), the
    per-block promotion in token order.

    Example:
      >>> a = jnp.ones((8, 256), jnp.float8_e4m3fn)
      >>> blocks = jnp.array([[0, 1], [1, 1]])  # expert 0: block 0, expert 1: block 1
      >>> dw = grouped_fp8_wgrad_matmul_reference(a, jnp.ones((8, 2)), a, jnp.ones((8, 2)),
      ...                                         blocks)
      >>> dw.shape, float(dw[1, 0, 0])
      ((2, 8, 8), 128.0)
    """
    out_dtype = _check_wgrad(a, a_scale, b, b_scale, group_blocks, out_dtype)
    nb = a.shape[1] // BLOCK_K
    blk = jnp.arange(nb)

    def one(blk0, nblk):
        keep = (blk >= blk0) & (blk < blk0 + nblk)
        # Blocks outside the expert get scale 0 on A: their products add exact zeros.
        return blockwise_fp8_matmul_reference(a, jnp.where(keep[None, :], a_scale, 0.0), b,
                                              b_scale, out_dtype=jnp.float32)

    return jax.vmap(one)(group_blocks[0], group_blocks[1]).astype(out_dtype)


@functools.partial(jax.jit, static_argnames=("out_dtype", "impl", "config"))
def grouped_fp8_wgrad_matmul(
    a: jax.Array, a_scale: jax.Array, b: jax.Array, b_scale: jax.Array,
    group_blocks: jax.Array, *, out_dtype: jax.typing.DTypeLike = jnp.float32,
    impl: Impl = "auto", config: TuningConfig | None = None,
) -> jax.Array:
    """Grouped weight-gradient GEMM on the padded token layout: ``out[g] = A_g · B_gᵀ``,
    ``A_g``/``B_g`` the columns (tokens) of expert g's 128-token blocks.

    Args:
      a: float8_e4m3fn ``[F1, T]``, tokens minor (e.g. ``dyᵀ``), T a multiple of 128.
      a_scale: float32 ``[F1, T/128]``, per 1x128 tile along the tokens.
      b: float8_e4m3fn ``[F2, T]`` (e.g. ``xᵀ``).
      b_scale: float32 ``[F2, T/128]``.
      group_blocks: int32 ``[2, G]``: each expert's first 128-token block and its count
        (``padded_token_layout``); an expert's blocks hold only its tokens (zeros after).
      out_dtype: float32 (default) or bfloat16.
      impl: as ``blockwise_fp8_matmul``.
      config: as ``blockwise_fp8_matmul``.

    Returns:
      ``[G, F1, F2]`` of ``out_dtype``; zeros for an expert without blocks.
    """
    out_dtype = _check_wgrad(a, a_scale, b, b_scale, group_blocks, out_dtype)
    kind = _backend.resolve_impl(impl)
    if kind == "reference":
        return grouped_fp8_wgrad_matmul_reference(a, a_scale, b, b_scale, group_blocks,
                                                  out_dtype=out_dtype)
    f1, t = a.shape
    f2 = b.shape[0]
    g = group_blocks.shape[1]
    config = _config(config, f1, f2, t, out_dtype)
    bm, bn = config.block_m, config.block_n
    f1p = pl.cdiv(f1, bm) * bm
    if f1p != f1:
        a = jnp.pad(a, ((0, f1p - f1), (0, 0)))
        a_scale = jnp.pad(a_scale, ((0, f1p - f1), (0, 0)), constant_values=1.0)
    n_tiles = pl.cdiv(f2, bn)
    bs_t = jnp.pad(b_scale.T, ((0, 0), (0, n_tiles * bn - f2)), constant_values=1.0)
    max_blocks = t // BLOCK_K
    stages = min(config.max_concurrent_steps, max_blocks)
    kernel = plgpu.kernel(
        functools.partial(_wgrad_kernel, config=config, m_tiles=f1p // bm, n_tiles=n_tiles,
                          num_groups=g, stages=stages, max_blocks=max_blocks),
        out_type=jax.ShapeDtypeStruct((g, f1p, f2), out_dtype),
        grid=(_backend.num_sms(impl),),
        grid_names=("sm",),
        num_threads=3,
        thread_name="wg",
        interpret=_backend.interpret_params(impl),
        kernel_name=kernel_name(config, out_dtype, wgrad=True),
    )
    out = kernel(group_blocks.astype(jnp.int32), a, a_scale.T, b, bs_t)
    return out[:, :f1] if f1p != f1 else out


@functools.partial(jax.jit, static_argnames=("out_dtype", "impl", "config"))
def grouped_fp8_wgrad(
    dy: jax.Array, x: jax.Array, group_sizes: jax.Array, *,
    out_dtype: jax.typing.DTypeLike = jnp.float32, impl: Impl = "auto",
    config: TuningConfig | None = None,
) -> jax.Array:
    """Weight gradient per expert, ``dw[g] = dy_gᵀ · x_g`` ``[G, N, K]`` (the layout of
    ``w``), from sorted tokens: scattered into the padded token layout
    (``padded_token_layout``: a copy of ``dy`` and ``x``, each expert on whole 128-token
    blocks), quantized 1x128 along the tokens (so no scale block spans two experts), then
    ``grouped_fp8_wgrad_matmul``. Tokens past ``sum(group_sizes)`` are dropped.

    Args:
      dy: floating ``[M, N]``, the output gradient (tokens sorted by expert).
      x: floating ``[M, K]``, the forward's input.
      group_sizes: int ``[G]``.
      out_dtype: as ``grouped_fp8_wgrad_matmul``.
      impl: as ``grouped_fp8_wgrad_matmul``.
      config: as ``grouped_fp8_wgrad_matmul``.

    Returns:
      ``[G, N, K]`` of ``out_dtype``.
    """
    for name, v in (("dy", dy), ("x", x)):
        if not hasattr(v, "shape") or v.ndim != 2:
            raise ValueError(f"{name} must be 2-D [M, ...], got {getattr(v, 'shape', v)}.")
    if dy.shape[0] != x.shape[0]:
        raise ValueError(f"dy.shape[0]={dy.shape[0]} and x.shape[0]={x.shape[0]} (tokens) "
                         f"must match.")
    if not hasattr(group_sizes, "shape") or group_sizes.ndim != 1:
        raise ValueError(f"group_sizes must be 1-D [G], got "
                         f"{getattr(group_sizes, 'shape', type(group_sizes).__name__)}.")
    _check_sizes(group_sizes, group_sizes.shape[0])
    dest, blocks, tp = padded_token_layout(group_sizes, dy.shape[0])

    def padded_t(v):
        return jnp.zeros((tp, v.shape[1]), v.dtype).at[dest].set(v, mode="drop").T

    g_q, g_s = quantize_1x128(padded_t(dy), impl=impl)
    x_q, x_s = quantize_1x128(padded_t(x), impl=impl)
    return grouped_fp8_wgrad_matmul(g_q, g_s, x_q, x_s, blocks, out_dtype=out_dtype,
                                    impl=impl, config=config)
