"""Blockwise-scaled FP8 matmul for Hopper (Mosaic GPU), DeepSeek-V3's training recipe.

``out = A · Bᵀ`` with A float8_e4m3fn ``[M, K]`` scaled per 1x128 tile (``a_scale``
``[M, K/128]``) and B float8_e4m3fn ``[N, K]`` (K-major, DeepSeek's ``[out, in]`` weight
layout) scaled per 128x128 block (``b_scale`` ``[ceil(N/128), K/128]``) or, for the weight
gradient, per 1x128 tile (``b_scale`` ``[N, K/128]``); the convention is fmtkit's,
``x ≈ values * scale``. Semantics (DeepSeek-V3, arXiv 2412.19437, §3.3.2, "increasing
accumulation precision": promote to f32 every N_C = 128 elements of K, applying the scales
at promotion):

    acc = 0                                                   (f32 [M, N])
    for kb in range(K // 128):
        p   = A[:, kb] @ B[:, kb]ᵀ                            (FP8 tensor cores, fresh f32)
        acc = acc + p * (a_scale[:, kb, None] * sb[None, :])  (sb[n] = b_scale[n // 128, kb],
    out = acc.astype(out_dtype)                                or b_scale[n, kb] per row)

Kernel structure (``_matmul_kernel``): a persistent grid of one CTA per SM walks the output
tiles (``plgpu.nd_loop`` + ``plgpu.planar_snake``); each CTA runs three warpgroups, one
issuing TMA copies into a shared-memory ring (``plgpu.emit_pipeline_warp_specialized``),
two computing. A ring slot holds one K block: the FP8 A and B tiles and, with
``config.scales == "smem"`` (opt-in), A's row scales and B's column scales (B scaled per
row). B's block scales are then staged once per output tile, as DeepGEMM does: each
compute warpgroup copies those of all K blocks for its columns into its own buffer (one
TMA copy and a barrier at the tile's start). Per K block and per 64-row pass of its tile,
a compute warpgroup

1. issues a ``plgpu.wgmma`` of FP8 operands (both K-major: FP8 ``wgmma`` cannot transpose)
   into a fresh f32 accumulator,
2. loads the scales while it runs: with ``scales="global"`` (the default) the *next* K
   block's, from global memory (L2; carried to the next step); with ``scales="smem"`` this
   K block's, from shared memory (no global loads in the K loop),
3. waits for the wgmma and, after its last pass, releases the slot
   (``manual_consumed_barriers``: one arrival per input, after every read of the slot),
   then
4. forms this block's scale product (after the wait: not live beside the in-flight
   accumulator) and promotes ``sum += fresh * (a_scale ⊗ b_scale)`` into the
   register-resident sum.

A's scale ring of "smem" costs a stage in most tiles (``config.with_scales``). A pass is
64 x ``pass_n``: up to 192 columns (the 128 x 144-192 tiles) whose B block scales may change
inside the pass (a per-column scale vector then, as with per-row B scales).

When the stages divide the K blocks (``config.pipeline_stages``), one pipeline runs through
all of a CTA's tiles (``pipeline_state``), so the ring is not drained and refilled between
tiles. The epilogue casts a warpgroup's sums to the output dtype and stores them with TMA
in chunks of 64 rows (at most 8 KiB each) staged in shared memory: with
``config.epilogue == "chunks"`` through two slots per warpgroup used in turn, waiting before
each chunk until at most one store is in flight; with ``"tile"`` (the shipped 64x128 and
64x256) through one slot per chunk of the warpgroup's tile, written at once and stored back
to back, waited for only at the next tile's epilogue, so the stores run during the next
tile's K loop.

With ``config.cluster`` (opt-in) the kernel launches clusters of two CTAs that take
neighbouring tiles (``cluster_tile``) and share one operand's tile, which each loads half of
and TMA multicasts to both (``make_pipeline``); the persistent loop walks cluster tiles, so
both CTAs run the same pipeline steps.
"""

from __future__ import annotations

import functools
from typing import Literal

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import _backend
from pallas_kernels._backend import Impl, pl, plgpu
from pallas_kernels.config import (
    BLOCK_K,
    TILE_SCALE_MAX_K_BLOCKS,
    TuningConfig,
    choose_config,
    chunks_per_tile,
    epilogue_n,
    epilogue_swizzle,
    output_slots,
    pipeline_stages,
    scale_widths,
    tile_scale_shape,
)
from pallas_kernels.quantize import quantize_1x128

__all__ = [
    "blockwise_fp8_dgrad",
    "blockwise_fp8_matmul",
    "blockwise_fp8_matmul_reference",
    "blockwise_fp8_wgrad",
]

_FP8 = jnp.dtype(jnp.float8_e4m3fn)
_OUT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))
KERNEL_NAME = "blockwise_fp8_matmul"


def _swizzled(dtype, swizzle: int = 128) -> tuple:
    """A ``swizzle``-byte swizzle with its (8, ``swizzle`` bytes) tiling; FP8 ``wgmma``
    operands need 128."""
    return (plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)),
            plgpu.SwizzleTransform(swizzle))


# --------------------------------------------------------------------------------------
# Kernel body (refs).


# Private fault injection for the race-detector tests (``tests/pallas_kernels``): each
# breaks one step of the synchronization protocol below. Never set outside tests.
_HAZARDS = ("release_before_wgmma", "release_before_wait", "read_after_release",
            "no_store_wait", "shared_output_slot", "tile_wait_leaves_one",
            "tile_scales_no_wait")


def make_pipeline(body, compute_context, *, config: TuningConfig, k_blocks, stages: int,
                  state=None, k_offset=0, scale_specs=()):
    """The warp-specialized K pipeline of one output tile: a TMA warpgroup fills a ring of
    ``stages`` (A, B[, scales]) K-block slots, two compute warpgroups run ``body`` on each.

    ``k_blocks`` may be traced (the grouped weight gradient: each expert's token blocks);
    ``k_offset`` shifts the K blocks read (the expert's first block). ``scale_specs``: the
    BlockSpecs of the scale inputs staged with the operands (see ``scale_specs``).

    With ``config.cluster`` (2, 1) the CTAs of a cluster share B's tile, with (1, 2) A's:
    that operand's BlockSpec is collective over the kernel's "cluster" axis, so each CTA
    loads half of it and TMA multicasts it to both, and the pipeline's consumed barriers
    become cluster barriers (a slot is refilled only when the compute warpgroups of both
    CTAs have released it)."""
    fp8_transforms = _swizzled(_FP8)
    cm, cn = config.cluster
    shared_a = ("cluster",) if cn == 2 else None
    shared_b = ("cluster",) if cm == 2 else None
    return plgpu.emit_pipeline_warp_specialized(
        body,
        grid=(k_blocks,),
        memory_registers=40,  # the TMA warpgroup needs few (JAX's Hopper matmul uses 40)
        in_specs=[
            plgpu.BlockSpec((config.block_m, BLOCK_K), lambda k: (0, k + k_offset),
                            transforms=fp8_transforms, collective_axes=shared_a),
            plgpu.BlockSpec((config.block_n, BLOCK_K), lambda k: (0, k + k_offset),
                            transforms=fp8_transforms, collective_axes=shared_b),
            *scale_specs,
        ],
        wg_axis="wg",
        num_compute_wgs=2,
        max_concurrent_steps=stages,
        compute_context=compute_context,
        # The compute warpgroups release a slot as soon as their wgmmas have read it,
        # before the promotion FMAs (the automatic release comes after the body).
        manual_consumed_barriers=True,
        pipeline_state=state,
    )


def scale_specs(config: TuningConfig, b_rows: bool, k_offset=0) -> tuple:
    """BlockSpecs of the scales as pipeline inputs, one K block per stage (a TMA copy in
    the stage of the operands): A's row scales and, with ``b_rows``, B's column scales;
    widths from ``config.scale_widths``. B's block scales are not in the ring: they are
    staged once per output tile (``tile_mainloop``'s ``tile_scales``)."""
    a_width, b_width = scale_widths(config, b_rows)
    a_spec = plgpu.BlockSpec((None, a_width), lambda k: (k + k_offset, 0))
    if not b_rows:
        return (a_spec,)
    return a_spec, plgpu.BlockSpec((None, b_width), lambda k: (k + k_offset, 0))


def pipeline_allocations(a_ref, b_ref, *, config: TuningConfig, k_blocks: int, stages: int,
                         scale_refs=(), b_rows: bool = False):
    """The shared memory ``make_pipeline`` needs (allocated once per CTA, reused by every
    tile's pipeline); ``a_ref``/``b_ref`` are 2-D ``[rows, K]`` views, ``scale_refs`` the
    scale inputs' views (empty: scales from global memory)."""
    def ignore(*_, **__):
        return None

    specs = scale_specs(config, b_rows) if scale_refs else ()
    return make_pipeline(ignore, ignore, config=config, k_blocks=k_blocks, stages=stages,
                         scale_specs=specs).get_allocations(a_ref, b_ref, *scale_refs)


def tile_mainloop(a_tile, b_tile, as_ref, bs_ref, *, allocs, config: TuningConfig, k_blocks,
                  b_rows: bool, stages: int, r0, c0, row0, col0, epilogue, state=None,
                  k_offset=0, hazard: str | None = None, scale_tiles=None, tile_scales=None):
    """The K loop and promotion of one CTA output tile, shared by every kernel here.

    ``a_tile`` [block_m, K] and ``b_tile`` [block_n, K] are the tile's e4m3 operand views
    in global memory; ``as_ref`` [K/128, rows] f32 holds A's scales (one contiguous row per
    K block), ``bs_ref`` B's, [K/128, cols] per row (``b_rows``) or [K/128, ceil(cols/128)]
    per 128x128 block. This warpgroup's tile starts at (``r0``, ``c0``) in the CTA tile and
    at (``row0``, ``col0``) in the scale arrays' rows and columns. ``k_blocks`` K blocks
    from ``k_offset`` are walked. ``epilogue(sums)`` receives the warpgroup's f32 sums, one
    (64, pass_n) array per ``config.passes`` entry. ``state``: the ``pipeline_state``
    (persistent pipelines, see ``_matmul_kernel``).

    ``scale_tiles``: None reads the scales from global memory (``as_ref``, ``bs_ref``), one
    K block ahead; else the scale views of this CTA tile that the pipeline stages into
    shared memory with the operands (``scale_specs``: A's [K/128, block_m] and, with
    ``b_rows``, B's [K/128, block_n]). ``tile_scales`` (with ``scale_tiles``, B scaled per
    block): (``bs_blocks`` [blocks, KBp] f32 in global memory, B's block scales one row
    per 128-column block; ``buf`` [2, n, KBp] f32 in shared memory; ``barrier``, two
    barriers): at the start of each output tile each compute warpgroup copies the rows of
    the ``n`` blocks from its first column's (``config.tile_scale_shape``) into
    ``buf[wg]`` with one TMA copy, waits for it on ``barrier[wg]``, and reads every K
    block's B scale from there. A pass that straddles 128-column blocks (the widths that
    are not multiples of 128) gets a column-scale vector from the three blocks it can
    meet, as ``b_rows`` does.
    """
    pass_n = config.pass_n
    smem = scale_tiles is not None
    # B block-scaled with passes that straddle 128-column blocks: per-column B scales.
    straddle = not b_rows and config.block_n % BLOCK_K != 0
    b_vectors = b_rows or straddle
    # Distinct column offsets of the passes: the row-scaled B's scale vector is loaded once
    # per column offset (256x128: both 64-row passes share it).
    pass_cols = tuple(sorted({pc for _, pc in config.passes}))

    def load_scales(kb):
        """K block ``kb``'s scales, straight from global memory (L2): per pass the A row
        scales (a 64-vector), and per distinct pass column either the B scale (one 128x128
        block; passes are aligned to it) or, with ``b_rows``, the pass's column-scale
        vector. Plain loads: no shared memory to fence."""
        kb = kb + k_offset
        a_s = tuple(plgpu.load(as_ref.at[kb, pl.ds(row0 + pr, 64)],
                               layout=plgpu.Layout.WGMMA.reduce(1), optimized=False)
                    for pr, _ in config.passes)
        if b_rows:
            b_s = tuple(plgpu.load(bs_ref.at[kb, pl.ds(col0 + pc, pass_n)],
                                   layout=plgpu.Layout.WGMMA.reduce(0),
                                   optimized=False) for pc in pass_cols)
        elif straddle:
            ws = (col0 - c0) // BLOCK_K
            blocks = tuple(bs_ref[kb, ws + j] for j in range(3))
            b_s = tuple(straddling_b_scales(blocks, pc) for pc in pass_cols)
        else:
            b_s = tuple(bs_ref[kb, (col0 + pc) // BLOCK_K] for pc in pass_cols)
        return a_s, b_s

    def read_staged_scales(kb, as_smem, bs_smem=None):
        """K block ``kb``'s scales from shared memory: the same values as
        ``load_scales``, A's (and with ``b_rows`` B's) from the pipeline slot at the CTA
        tile's offsets (``r0``, ``c0``), B's block scales from the warpgroup's per-tile
        buffer (block j of the buffer: the warpgroup's j-th 128-column block)."""
        a_s = tuple(plgpu.load(as_smem.at[pl.ds(r0 + pr, 64)],
                               layout=plgpu.Layout.WGMMA.reduce(1), optimized=False)
                    for pr, _ in config.passes)
        if b_rows:
            b_s = tuple(plgpu.load(bs_smem.at[pl.ds(c0 + pc, pass_n)],
                                   layout=plgpu.Layout.WGMMA.reduce(0), optimized=False)
                        for pc in pass_cols)
            return a_s, b_s
        buf = tile_scales[1].at[lax.axis_index("wg")]
        if straddle:
            blocks = (buf[0, kb], buf[1, kb], buf[2, kb])
            b_s = tuple(straddling_b_scales(blocks, pc) for pc in pass_cols)
        else:
            # The warpgroup's first column is 0 or 64 past a block's start (its tile is
            # 64, 128 or 256 columns wide): pass column pc is in its block pc // 128.
            b_s = tuple(buf[pc // BLOCK_K, kb] for pc in pass_cols)
        return a_s, b_s

    def stage_tile_scales():
        """B's block scales of this warpgroup's tile for every K block: one TMA copy into
        its own buffer, awaited. Its reads of the previous tile's buffer are done (program
        order: plain loads, consumed by the promotion); the proxy fence orders them before
        the TMA's overwrite."""
        bs_blocks, buf, barrier = tile_scales
        wg = lax.axis_index("wg")
        plgpu.commit_smem()
        plgpu.copy_gmem_to_smem(bs_blocks.at[pl.ds(col0 // BLOCK_K, buf.shape[1]), :],
                                buf.at[wg], barrier.at[wg])
        if hazard == "tile_scales_no_wait":
            buf.at[wg][0, 0]  # a read of the buffer before the copy has landed
        plgpu.barrier_wait(barrier.at[wg])

    def straddling_b_scales(blocks, pc):
        """The pass's (pass_n,) column scales from the block scales of the three 128-column
        blocks from the CTA tile's first column: a pass of at most 192 columns meets at
        most three."""
        first = col0 + pc  # the pass's first column
        window = (col0 - c0) // BLOCK_K * BLOCK_K  # first column of the window's block
        to_next = window + BLOCK_K - first  # columns of the pass in the window's block
        cols = plgpu.broadcasted_iota(jnp.int32, (pass_n,), 0,
                                      layout=plgpu.Layout.WGMMA.reduce(0))
        s0, s1, s2 = blocks
        return jnp.where(cols < to_next, s0, jnp.where(cols < to_next + BLOCK_K, s1, s2))

    def scale_product(scales, p):
        """The (64, pass_n) scale of pass ``p``, formed after the wgmma wait (so it is not
        live beside the in-flight accumulator: 64 registers a thread)."""
        a_s, b_s = scales
        _, pc = config.passes[p]
        b = b_s[pass_cols.index(pc)]
        if b_vectors:
            return (lax.broadcast_in_dim(a_s[p], (64, pass_n), [0])
                    * lax.broadcast_in_dim(b, (64, pass_n), [1]))
        return lax.broadcast_in_dim(a_s[p] * b, (64, pass_n), [0])

    def compute_context(run_pipeline):
        if tile_scales is not None:
            stage_tile_scales()
        sums = tuple(plgpu.layout_cast(jnp.zeros((64, pass_n), jnp.float32),
                                       plgpu.Layout.WGMMA) for _ in config.passes)
        sums, _ = run_pipeline((sums, () if smem else load_scales(0)))
        epilogue(sums)

    def k_step(idxs, *refs):
        (kb,) = idxs
        *refs, (sums, scales) = refs
        n_in = len(refs) // 2
        smem_refs, consumed = refs[:n_in], refs[n_in:]
        a_smem, b_smem = smem_refs[:2]

        def release():
            for barrier in consumed:
                plgpu.barrier_arrive(barrier)

        if hazard == "release_before_wgmma":
            release()
        nxt = None
        out = []
        for p, ((pr, pc), acc) in enumerate(zip(config.passes, sums)):
            last = p == len(sums) - 1

            def product(acc_ref, pr=pr, pc=pc, p=p, last=last):
                # B is [N, K] in memory; the transposed view is the K-major RHS.
                plgpu.wgmma(acc_ref, a_smem.at[pl.ds(r0 + pr, 64)],
                            b_smem.at[pl.ds(c0 + pc, pass_n)].T)
                if last and hazard == "release_before_wait":
                    release()
                if smem:
                    # This K block's scales, read from its slot while the wgmmas run
                    # (before the slot's release below).
                    got = read_staged_scales(kb, *smem_refs[2:]) if p == 0 else None
                else:
                    # The next K block's scales, in flight while the wgmmas run (the last
                    # step reloads its own: the index stays in bounds).
                    got = load_scales(jnp.minimum(kb + 1, k_blocks - 1)) if last else None
                return acc_ref[...], got  # reading the accumulator waits for it

            fresh, got = pl.run_scoped(product, plgpu.ACC((64, pass_n), jnp.float32))
            if smem and p == 0:
                scales = got
            if last:
                nxt = () if smem else got
                # Every wgmma of this K block has completed: release the slot.
                if hazard not in ("release_before_wgmma", "release_before_wait"):
                    release()
                if hazard == "read_after_release":
                    # A plain read of the released slot (the TMA may be refilling it).
                    fresh = fresh + a_smem[0:64, 0:pass_n].astype(jnp.float32) * 0.0
            out.append(acc + fresh * scale_product(scales, p))
        return tuple(out), nxt

    inputs = (a_tile, b_tile, *(scale_tiles or ()))
    specs = scale_specs(config, b_rows, k_offset) if smem else ()
    make_pipeline(k_step, compute_context, config=config, k_blocks=k_blocks, stages=stages,
                  state=state, k_offset=k_offset, scale_specs=specs)(
                      *inputs, allocations=allocs)


def run_tiles_persistent(run, first, last, persistent: bool) -> None:
    """Calls ``run(pipeline_state)`` for one of a CTA's tiles: with ``persistent``, one
    pipeline runs through all the CTA's tiles (START on its ``first`` tile, STEADY, STOP on
    its ``last``; a CTA with one tile runs a self-contained pipeline); else every tile runs
    its own."""
    if not persistent:
        run(None)
        return
    start, steady, stop = (plgpu.PipelinePipeline.START,
                           plgpu.PipelinePipeline.STEADY, plgpu.PipelinePipeline.STOP)
    pl.when(first & last)(lambda: run(None))  # the CTA's only tile
    pl.when(first & ~last)(lambda: run(start))
    pl.when(~first & ~last)(lambda: run(steady))
    pl.when(~first & last)(lambda: run(stop))


def store_passes(sums, out_ref, my_smem, *, config: TuningConfig, row0, col0, chunk,
                 hazard: str | None = None):
    """Casts and stores a warpgroup's sums to ``out_ref`` rows ``row0 + pr``, columns
    ``col0 + pc`` per pass, through the warpgroup's staging slots ``my_smem``
    (``output_slots``) with TMA (the tensor's bounds clip the store), in chunks of 64 x
    ``epilogue_n``. ``config.epilogue == "chunks"``: two slots used in turn, ``chunk`` the
    CTA's count of chunks stored before this tile (the slots alternate over it);
    ``"tile"``: see ``store_tile``."""
    if config.epilogue == "tile":
        store_tile(sums, out_ref, my_smem, config=config, row0=row0, col0=col0,
                   hazard=hazard)
        return
    out_dtype = out_ref.dtype
    epi_n = epilogue_n(config, out_dtype)
    for (pr, pc), acc in zip(config.passes, sums):
        for e in range(0, config.pass_n, epi_n):
            slot = lax.rem(chunk, 2)
            chunk = chunk + 1
            # At most one store in flight: the one from the other slot.
            if hazard != "no_store_wait":
                plgpu.wait_smem_to_gmem(1, wait_read_only=True)
            my_smem[slot] = acc[:, e:e + epi_n].astype(out_dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(
                my_smem.at[slot],
                out_ref.at[pl.ds(row0 + pr, 64), pl.ds(col0 + pc + e, epi_n)])


def store_tile(sums, out_ref, my_smem, *, config: TuningConfig, row0, col0,
               hazard: str | None = None):
    """The "tile" epilogue: one slot of ``my_smem`` per chunk of the warpgroup's tile.
    Waits until the previous tile's stores have read the slots (the only wait on them: they
    ran during this tile's K loop), writes every chunk, makes the writes visible to the TMA
    once, then issues the stores back to back, left in flight for the next tile's K loop
    (the next call, or the kernel's last wait, waits for them)."""
    out_dtype = out_ref.dtype
    epi_n = epilogue_n(config, out_dtype)
    if hazard != "no_store_wait":
        # The chunks form's count: the previous tile's last store may still read its slot.
        plgpu.wait_smem_to_gmem(1 if hazard == "tile_wait_leaves_one" else 0,
                                wait_read_only=True)
    dsts = []
    for (pr, pc), acc in zip(config.passes, sums):
        for e in range(0, config.pass_n, epi_n):
            my_smem[len(dsts)] = acc[:, e:e + epi_n].astype(out_dtype)
            dsts.append(out_ref.at[pl.ds(row0 + pr, 64), pl.ds(col0 + pc + e, epi_n)])
    plgpu.commit_smem()
    for slot, dst in enumerate(dsts):
        plgpu.copy_smem_to_gmem(my_smem.at[slot], dst)


def wg_origin(config: TuningConfig, wg):
    """(row, column) of warpgroup ``wg``'s tile inside the CTA tile."""
    if config.wg_split == "m":
        return wg * config.wg_m, 0
    return 0, wg * config.wg_n


def cluster_tile(mi, ni, cluster: tuple[int, int], cta):
    """The output tile of CTA ``cta`` of a cluster at cluster tile (``mi``, ``ni``): along
    M, tile row ``2 mi + cta`` in tile column ``ni`` (both CTAs share B's tile, which is
    multicast); along N, tile column ``2 ni + cta`` in tile row ``mi`` (sharing A's);
    without a cluster, (``mi``, ``ni``)."""
    cm, cn = cluster
    if cm == 2:
        return mi * 2 + cta, ni
    if cn == 2:
        return mi, ni * 2 + cta
    return mi, ni


def _matmul_kernel(a_ref, as_ref, b_ref, bs_ref, out_ref, *, config: TuningConfig,
                   m_tiles: int, n_tiles: int, k_blocks: int, b_rows: bool, stages: int,
                   persistent: bool, hazard: str | None = None):
    """One persistent CTA: ``a_ref`` [Mp, K] e4m3, ``as_ref`` [K/128, Mp] f32 (A scales,
    transposed so a K block's scales are one contiguous row), ``b_ref`` [Np, K] e4m3,
    ``bs_ref`` f32 B scales, transposed: [K/128, Np] per row (``b_rows``) or
    [K/128, ceil(Np/128)] per 128x128 block (with ``scales="smem"``, not transposed: one
    row of K blocks per 128-column block, padded as ``tile_scale_shape`` says),
    ``out_ref`` [Mp, Np].

    With ``persistent``, one pipeline runs through all the CTA's output tiles: the TMA
    warpgroup fetches the next tile's first K blocks while the compute warpgroups finish
    the current one (``pipeline_state``: START on the CTA's first tile, STEADY, STOP on
    its last; a CTA with one tile runs a self-contained pipeline).

    Synchronization protocol (why each wait and release is safe):

    * Ring slot s (A and B tiles of one K block): the TMA warpgroup waits on s's two
      *consumed* barriers before refilling it; each has ``2 x 128`` expected arrivals
      (two compute warpgroups; Mosaic GPU's Lane semantics counts every thread, see
      below). A compute warpgroup arrives only after ``acc_ref[...]`` of its last pass
      has returned, and reading a ``plgpu.ACC`` accumulator is a ``wgmma.wait_group 0``:
      every ``wgmma`` of this K block, the only readers of s, has completed. The
      ``mbarrier.arrive`` has release semantics, the TMA's wait acquire, so the async
      proxy's overwrite is ordered after the tensor core's reads. The staged scales are
      read (plain shared-memory loads) in the first pass's window, before the arrival in
      program order, which its release semantics also orders before the overwrite.
      Nothing writes the ring but the TMA, so no proxy fence is needed.
    * *Produced* barriers (the pipeline's): a compute warpgroup reads slot s only after
      the TMA transaction bytes of both tiles have landed (``emit_pipeline`` waits).
    * Scales, ``scales="global"``: plain global loads of read-only inputs, no hazard,
      issued one K block ahead (carried) so their latency hides behind a whole step.
    * B's block scales, ``scales="smem"``: each compute warpgroup owns a per-tile buffer
      and a barrier. At a tile's start it fences (``commit_smem``: its plain reads of the
      previous tile's scales, finished in program order, before the async proxy's
      overwrite), issues one TMA copy arriving on its barrier and waits for it before
      its first read; one phase per tile, observed by its only waiter.
    * Output staging, ``epilogue="chunks"``: each warpgroup owns two 8 KiB slots of
      ``out_smem``, used in turn over all of the CTA's output chunks (across tiles). Before
      writing slot j it waits until at most one of its own TMA stores is still reading
      shared memory (``wait_smem_to_gmem(1, wait_read_only=True)``): stores complete in
      order, so the older one, the last reader of slot j, has finished.
      ``epilogue="tile"``: each warpgroup owns one slot per chunk of its tile. Its
      epilogue first waits until *all* its TMA stores have read shared memory
      (``wait_smem_to_gmem(0, wait_read_only=True)``; 1 would leave the previous tile's
      last store reading the last slot): those are the previous tile's, issued at the end
      of its epilogue and in flight during this tile's K loop. It then writes every slot
      and issues the stores back to back, with no wait between them. In both forms
      ``commit_smem`` (a ``fence.proxy.async`` and a warpgroup barrier) makes the
      generic-proxy writes visible to the TMA stores, which one thread issues; a wait
      (``cp.async.bulk.wait_group.read``, Mosaic GPU adds a warpgroup barrier) is by that
      thread for its own stores. The warpgroups never share a slot; the kernel's last
      ``wait_smem_to_gmem(0)`` keeps the CTA alive until its stores have read shared
      memory.

    * Clusters (``config.cluster``): the shared operand's slot in both CTAs is written by
      the multicast copies of both, so a CTA's TMA warpgroup may refill slot s only when
      the compute warpgroups of *both* CTAs have released it. The pipeline makes every
      consumed barrier a cluster barrier for this: each warpgroup's ``barrier_arrive``
      arrives once (from one thread, after its ``wgmma.wait_group``) on the barrier of
      each CTA, 2 x 2 arrivals expected. Both CTAs walk the same cluster tiles, so their
      pipelines run the same steps and the quiescing waits of the last tile see every
      remote arrival before either CTA exits. A CTA whose tile lies past M or N (odd
      tile count) runs the same steps on zero-filled operands and its stores are dropped.
      The staged scales (``scales="smem"``) are read by every thread and would not be
      ordered before that single-thread arrival: ``TuningConfig`` refuses the combination.

    One arrival per warpgroup instead of per thread would need barriers with a single
    arrival: Mosaic GPU (0.11.2) multiplies the expected arrivals of every barrier that
    ``emit_pipeline_warp_specialized`` allocates by 128 in Lane semantics
    (``lowering.arrival_multiplier``) and arrives from one lane only for
    ``orders_tensor_core`` barriers (Blackwell's tcgen05), so 128 arrivals it is.

    The K loop and promotion (``tile_mainloop``) and the stores (``store_passes``) are
    shared with the grouped kernel (``pallas_kernels.grouped_fp8_matmul``).
    """
    bm, bn = config.block_m, config.block_n
    out_dtype = out_ref.dtype
    epi_n = epilogue_n(config, out_dtype)
    per_tile = chunks_per_tile(config, out_dtype)
    smem_scales = config.scales == "smem"

    def scale_tiles(mi, ni):
        """The scale views of output tile (mi, ni) the pipeline stages: A's, and B's with
        ``b_rows`` (B's block scales are staged per tile: ``tile_scales``)."""
        if not smem_scales:
            return None
        a_width, b_width = scale_widths(config, b_rows)
        a_view = as_ref.at[:, pl.ds(mi * bm, a_width)]
        if not b_rows:
            return (a_view,)
        return a_view, bs_ref.at[:, pl.ds(ni * bn, b_width)]

    # B's block scales once per tile: [warpgroup, block, K block] and a barrier per
    # warpgroup (``tile_mainloop``'s ``tile_scales``).
    tile_allocs = {}
    if smem_scales and not b_rows:
        tile_allocs = dict(
            tile_buf=plgpu.SMEM(tile_scale_shape(config, k_blocks), jnp.float32),
            tile_barrier=plgpu.Barrier(num_barriers=2))

    @functools.partial(
        pl.run_scoped,
        allocs=pipeline_allocations(a_ref, b_ref, config=config, k_blocks=k_blocks,
                                    stages=stages, scale_refs=scale_tiles(0, 0) or (),
                                    b_rows=b_rows),
        # [warpgroup, slot]: two 8 KiB slots per warpgroup (double-buffered stores), or
        # one per chunk of its tile (``config.epilogue == "tile"``).
        out_smem=plgpu.SMEM((2, output_slots(config, out_dtype), 64, epi_n), out_dtype,
                            transforms=_swizzled(out_dtype,
                                                 epilogue_swizzle(config, out_dtype))),
        collective_axes="wg",
        **tile_allocs,
    )
    def _scope(allocs, out_smem, tile_buf=None, tile_barrier=None):
        wg = lax.axis_index("wg")
        minor = 0 if config.grid_minor_dim == "m" else 1
        my_smem = out_smem.at[0 if hazard == "shared_output_slot" else wg]

        cm, cn = config.cluster
        # Clusters walk the grid of cluster tiles (cm x cn output tiles) in the planar
        # snake; every CTA of a cluster walks the same ones (``nd_loop`` over "sm" only).
        grid_mn = (pl.cdiv(m_tiles, cm), pl.cdiv(n_tiles, cn))

        @plgpu.nd_loop((grid_mn[0] * grid_mn[1],), collective_axes="sm")
        def _tile(info):
            (lin,) = info.index
            mi, ni = plgpu.planar_snake(lin, grid_mn, minor, config.grid_tile_width)
            if cm * cn > 1:
                mi, ni = cluster_tile(mi, ni, config.cluster, lax.axis_index("cluster"))
            r0, c0 = wg_origin(config, wg)
            # This warpgroup's tile in absolute coordinates.
            row0, col0 = mi * bm + r0, ni * bn + c0

            def epilogue(sums):
                # "chunks" epilogue: the slots alternate over the CTA's whole sequence of
                # chunks, across tiles: with an odd count per tile (one: 64x128 bf16),
                # restarting at slot 0 on every tile would overwrite a slot whose store
                # may still be reading it.
                store_passes(sums, out_ref, my_smem, config=config, row0=row0, col0=col0,
                             chunk=info.local_index * per_tile, hazard=hazard)

            def run(state):
                tile_mainloop(a_ref.at[pl.ds(mi * bm, bm), :], b_ref.at[pl.ds(ni * bn, bn), :],
                              as_ref, bs_ref, allocs=allocs, config=config,
                              k_blocks=k_blocks, b_rows=b_rows, stages=stages, r0=r0, c0=c0,
                              row0=row0, col0=col0, epilogue=epilogue, state=state,
                              hazard=hazard, scale_tiles=scale_tiles(mi, ni),
                              tile_scales=None if tile_buf is None
                              else (bs_ref, tile_buf, tile_barrier))

            run_tiles_persistent(run, info.local_index == 0,
                                 info.local_index == info.num_local_steps - 1, persistent)

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _kernel_call(a, as_t, b, bs_t, *, config: TuningConfig, out_dtype, impl: Impl,
                 b_rows: bool, n_out: int | None = None, hazard: str | None = None):
    """Launches the kernel on operands padded to whole tiles (``M % block_m == 0``; B's
    rows and the output columns may stop short of a whole tile: ``n_out`` columns)."""
    if hazard is not None and hazard not in _HAZARDS:
        raise ValueError(f"hazard must be one of {_HAZARDS} or None, got {hazard!r}.")
    m, k = a.shape
    n = b.shape[0] if n_out is None else n_out
    if config.scales == "global" and not b_rows and config.block_n % BLOCK_K:
        bs_t = _pad_columns(bs_t, bs_t.shape[1] + 2)  # the three blocks a pass may meet
    if config.scales == "smem":
        # Every tile's scale slots (``scale_widths``: past the tile for narrow tiles) stay
        # in bounds, and the rows are a multiple of 16 bytes apart (a TMA source's strides
        # must be).
        a_width, b_width = scale_widths(config, b_rows)
        as_t = _pad_columns(as_t, as_t.shape[1] + a_width - config.block_m)
        if b_rows:
            bs_t = _pad_columns(bs_t, bs_t.shape[1] + b_width - config.block_n)
        else:
            # B's block scales staged per tile: one row of K blocks per 128-column block
            # (``tile_scale_shape``), rows past the last tile's window and K blocks up to
            # the buffer's padded count filled with ones.
            _, blocks, kb_pad = tile_scale_shape(config, k // BLOCK_K)
            if k // BLOCK_K > TILE_SCALE_MAX_K_BLOCKS:
                raise ValueError(
                    f"scales='smem' stages B's block scales for all of K in one TMA copy: "
                    f"k must be at most {TILE_SCALE_MAX_K_BLOCKS * BLOCK_K}, got k={k}; "
                    f"use scales='global'.")
            bs_t = _pad_columns(bs_t.T, kb_pad)
            bs_t = jnp.pad(bs_t, ((0, blocks - 1), (0, 0)), constant_values=1.0)
    m_tiles, n_tiles, k_blocks = m // config.block_m, pl.cdiv(n, config.block_n), k // BLOCK_K
    cm, cn = config.cluster
    if cm == 2 and m_tiles % 2:
        # The last cluster's second CTA computes a tile of rows past M (TMA zero-fills its
        # A and drops its stores); its scale loads stay in bounds on padding.
        as_t = _pad_columns(as_t, as_t.shape[1] + config.block_m)
    if cn == 2 and n_tiles % 2:
        bs_t = _pad_columns(bs_t, bs_t.shape[1] + (config.block_n if b_rows
                                                   else pl.cdiv(config.block_n, BLOCK_K)))
    stages, persistent = pipeline_stages(config, k_blocks)
    clusters = pl.cdiv(m_tiles, cm) * pl.cdiv(n_tiles, cn)
    grid = min(_backend.num_sms(impl) // (cm * cn), clusters)
    cluster_args = (dict(cluster=(cm * cn,), cluster_names=("cluster",)) if cm * cn > 1
                    else {})
    kernel = plgpu.kernel(
        functools.partial(_matmul_kernel, config=config, m_tiles=m_tiles, n_tiles=n_tiles,
                          k_blocks=k_blocks, b_rows=b_rows, stages=stages,
                          persistent=persistent, hazard=hazard),
        out_type=jax.ShapeDtypeStruct((m, n), out_dtype),
        grid=(grid,),
        grid_names=("sm",),
        num_threads=3,
        thread_name="wg",
        interpret=_backend.interpret_params(impl),
        kernel_name=kernel_name(config, out_dtype, b_rows),
        **cluster_args,
    )
    return kernel(a, as_t, b, bs_t)


def _pad_columns(x, width: int):
    """``x`` [rows, cols] padded with ones to ``width`` columns rounded up to 4 (16 bytes)."""
    return jnp.pad(x, ((0, 0), (0, -(-width // 4) * 4 - x.shape[1])), constant_values=1.0)


def kernel_name(config: TuningConfig, out_dtype, b_rows: bool) -> str:
    """The compiled kernel's name, unique per variant (tiles, stages, output dtype, B's
    scale layout), so that ptxas's report and profiles say which variant they are about."""
    form = "_brows" if b_rows else ""
    return f"{KERNEL_NAME}_{config}_{jnp.dtype(out_dtype).name}{form}"


# --------------------------------------------------------------------------------------
# Validation.


def _check_operands(a, a_scale, b, b_scale, out_dtype, b_layout):
    """Validates; returns (a [M, K], a_scale [M, KB], b [N, K], b_scale [NB or N, KB],
    b_rows, lead dims, out_dtype)."""
    if b_layout not in ("nk", "kn"):
        raise ValueError(f"b_layout must be 'nk' ([N, K], DeepSeek's weight layout) or 'kn' "
                         f"([K, N]), got {b_layout!r}.")
    for name, x in (("a", a), ("b", b)):
        if not hasattr(x, "dtype") or jnp.dtype(x.dtype) != _FP8:
            dt = getattr(x, "dtype", type(x).__name__)
            raise TypeError(f"{name} must be a float8_e4m3fn array, got dtype {dt}.")
    for name, x in (("a_scale", a_scale), ("b_scale", b_scale)):
        if not hasattr(x, "dtype") or jnp.dtype(x.dtype) != jnp.float32:
            dt = getattr(x, "dtype", type(x).__name__)
            raise TypeError(f"{name} must be a float32 array, got dtype {dt}.")
    out_dtype = jnp.dtype(out_dtype)
    if out_dtype not in _OUT_DTYPES:
        raise ValueError(f"out_dtype must be bfloat16 or float32, got {out_dtype}.")
    if a.ndim < 2:
        raise ValueError(f"a must have shape [..., M, K] (ndim >= 2), got shape {a.shape}.")
    if b.ndim != 2:
        raise ValueError(f"b must be 2-D, got shape {b.shape}.")
    if b_scale.ndim != 2:
        raise ValueError(f"b_scale must be 2-D, got shape {b_scale.shape}.")
    if b_layout == "kn":
        b, b_scale = b.T, b_scale.T
    n, k = b.shape
    if a.shape[-1] != k:
        raise ValueError(f"a.shape[-1]={a.shape[-1]} must equal K={k} from b.shape={b.shape} "
                         f"(b_layout={b_layout!r}).")
    if k % BLOCK_K:
        raise ValueError(f"k={k} must be divisible by block_k={BLOCK_K}.")
    kb = k // BLOCK_K
    lead = a.shape[:-1]
    want_as = (*lead, kb)
    if tuple(a_scale.shape) != want_as:
        raise ValueError(f"a_scale must have shape {want_as} (one scale per 1x{BLOCK_K} tile "
                         f"of a {a.shape}), got {a_scale.shape}.")
    blocks, rows = (pl.cdiv(n, BLOCK_K), kb), (n, kb)
    if tuple(b_scale.shape) not in (blocks, rows):
        flip = (lambda t: t) if b_layout == "nk" else (lambda t: tuple(t)[::-1])
        raise ValueError(f"b_scale must have shape {flip(blocks)} (one scale per "
                         f"{BLOCK_K}x{BLOCK_K} block of b) or {flip(rows)} (one per "
                         f"1x{BLOCK_K} tile), b_layout={b_layout!r}; got "
                         f"{flip(b_scale.shape)}.")
    b_rows = tuple(b_scale.shape) == rows and rows != blocks
    m = 1
    for d in lead:
        m *= d
    return a.reshape(m, k), a_scale.reshape(m, kb), b, b_scale, b_rows, lead, out_dtype


# --------------------------------------------------------------------------------------
# Public API.


def _reference_2d(a, a_scale, b, b_scale, b_rows, out_dtype):
    m, k = a.shape
    n = b.shape[0]
    kb = k // BLOCK_K
    a_blocks = a.reshape(m, kb, BLOCK_K).transpose(1, 0, 2)  # [KB, M, 128] (still FP8)
    b_blocks = b.reshape(n, kb, BLOCK_K).transpose(1, 0, 2)  # [KB, N, 128]
    # [N, KB]: each output column's scale per K block.
    b_cols = b_scale if b_rows else jnp.repeat(b_scale, BLOCK_K, axis=0)[:n]

    def step(acc, xs):
        a_k, b_k, as_k, bs_k = xs
        # Products of e4m3 values are exact in f32; HIGHEST keeps XLA GPU off TF32.
        p = jnp.dot(a_k.astype(jnp.float32), b_k.astype(jnp.float32).T,
                    precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
        s = as_k[:, None] * bs_k[None, :]
        return acc + p * s, None

    acc, _ = lax.scan(step, jnp.zeros((m, n), jnp.float32),
                      (a_blocks, b_blocks, a_scale.T, b_cols.T))
    return acc.astype(out_dtype)


@functools.partial(jax.jit, static_argnames=("out_dtype", "b_layout"))
def blockwise_fp8_matmul_reference(
    a: jax.Array, a_scale: jax.Array, b: jax.Array, b_scale: jax.Array, *,
    out_dtype: jax.typing.DTypeLike = jnp.bfloat16, b_layout: Literal["nk", "kn"] = "nk",
) -> jax.Array:
    """Pure-JAX semantics of ``blockwise_fp8_matmul``: the same per-K-block promotion.

    Exact f32 partial products per 128-wide K block, scaled and summed into an f32
    accumulator in the kernel's order (see the module docstring). Runs anywhere; it is the
    fallback of ``blockwise_fp8_matmul`` where the kernel does not apply.

    Args and Returns: as ``blockwise_fp8_matmul``.

    Example:
      >>> a = jnp.ones((4, 128), jnp.float8_e4m3fn)
      >>> b = jnp.ones((8, 128), jnp.float8_e4m3fn)
      >>> out = blockwise_fp8_matmul_reference(
      ...     a, jnp.full((4, 1), 0.5), b, jnp.ones((1, 1)), out_dtype=jnp.float32)
      >>> float(out[0, 0])
      64.0
    """
    a2, as2, b2, bs2, b_rows, lead, out_dtype = _check_operands(a, a_scale, b, b_scale,
                                                                out_dtype, b_layout)
    out = _reference_2d(a2, as2, b2, bs2, b_rows, out_dtype)
    return out.reshape(*lead, b2.shape[0])


@functools.partial(jax.jit, static_argnames=("out_dtype", "b_layout", "impl", "config"))
def blockwise_fp8_matmul(
    a: jax.Array, a_scale: jax.Array, b: jax.Array, b_scale: jax.Array, *,
    out_dtype: jax.typing.DTypeLike = jnp.bfloat16, b_layout: Literal["nk", "kn"] = "nk",
    impl: Impl = "auto", config: TuningConfig | None = None,
) -> jax.Array:
    """Blockwise-scaled FP8 matmul ``A · Bᵀ`` with DeepSeek-V3's f32 promotion per K block.

    Args:
      a: float8_e4m3fn ``[..., M, K]`` (activations; leading dims are flattened into M).
      a_scale: float32 ``[..., M, K/128]``, one scale per 1x128 tile of ``a``.
      b: float8_e4m3fn ``[N, K]``, K-major: DeepSeek's ``[out_features, in_features]``
        weight layout, which is what FP8 ``wgmma`` reads. With ``b_layout="kn"``, b is
        ``[K, N]`` (e.g. a Flax ``Dense`` kernel) and is transposed first (an extra copy of
        b per call: store weights as ``[N, K]`` to avoid it).
      b_scale: float32 ``[ceil(N/128), K/128]``, one scale per 128x128 block of b (a last
        partial block of rows is allowed), or ``[N, K/128]``, one per 1x128 tile (the
        weight-gradient GEMM's re-quantized activations; costs a column-scale vector in
        registers and one more multiply per element). Transposed with ``b_layout="kn"``.
      out_dtype: bfloat16 (default) or float32.
      b_layout: "nk" (default) or "kn", see ``b``.
      impl: "auto" (the kernel on a Hopper GPU, else the reference), "kernel" (compiled
        Mosaic GPU kernel), "interpret" (the kernel in GPU-interpret mode, on CPU), a
        ``plgpu.InterpretGPUParams`` (interpret with those options), or "reference".
      config: a ``pallas_kernels.config.TuningConfig``; default
        ``choose_config(M, N, K, out_dtype)``.

    Returns:
      ``[..., M, N]`` array of ``out_dtype``.

    Raises:
      TypeError: a or b is not float8_e4m3fn, or a scale is not float32.
      ValueError: K not divisible by 128, mismatched K, scale shapes that do not match the
        blocks, an unsupported ``out_dtype``, ``b_layout`` or ``impl``.

    M and N need not be multiples of the tile: the kernel path pads them with zeros (a copy
    of A and/or B; choose shapes that are multiples of 128 to avoid it) and slices the
    result.

    Example:
      >>> from pallas_kernels import quantize_1x128, quantize_128x128
      >>> xq, xs = quantize_1x128(jnp.ones((256, 512)))
      >>> wq, ws = quantize_128x128(jnp.ones((384, 512)))
      >>> y = blockwise_fp8_matmul(xq, xs, wq, ws)  # [256, 384] bf16, = 512 everywhere
    """
    a2, as2, b2, bs2, b_rows, lead, out_dtype = _check_operands(a, a_scale, b, b_scale,
                                                                out_dtype, b_layout)
    kind = _backend.resolve_impl(impl)
    m, k = a2.shape
    n = b2.shape[0]
    if kind == "reference":
        out = _reference_2d(a2, as2, b2, bs2, b_rows, out_dtype)
        return out.reshape(*lead, n)
    if config is None:
        config = choose_config(m, n, k, out_dtype, _backend.num_sms("kernel"), b_rows=b_rows)
    elif not isinstance(config, TuningConfig):
        raise TypeError(f"config must be a TuningConfig or None, got {type(config).__name__}.")
    mp = pl.cdiv(m, config.block_m) * config.block_m
    np_ = pl.cdiv(n, config.block_n) * config.block_n
    if mp != m:  # zero rows: their products are zero, any finite scale will do
        a2 = jnp.pad(a2, ((0, mp - m), (0, 0)))
        as2 = jnp.pad(as2, ((0, mp - m), (0, 0)), constant_values=1.0)
    # B and the output are not padded along N: the last column tile's TMA loads read zeros
    # past B's last row and its TMA stores drop the columns past N (the hardware clips
    # both at the tensor's bounds). Only the scale rows are padded to whole tiles.
    # Scales transposed, one contiguous row per K block (what the kernel reads per step):
    # A's per row; B's per row or per 128-row block (padding scales are 1; they only meet
    # the zeros past B's end).
    as_t = as2.T  # [KB, Mp]
    width = np_ if b_rows else pl.cdiv(np_, BLOCK_K)
    bs_t = jnp.pad(bs2.T, ((0, 0), (0, width - bs2.shape[0])), constant_values=1.0)
    out = _kernel_call(a2, as_t, b2, bs_t, config=config, out_dtype=out_dtype, impl=impl,
                       b_rows=b_rows)
    if mp != m:
        out = out[:m]
    return out.reshape(*lead, n)


# --------------------------------------------------------------------------------------
# Gradient GEMMs of the blockwise recipe, expressed with the same kernel.


@functools.partial(jax.jit, static_argnames=("out_dtype", "impl", "config"))
def blockwise_fp8_dgrad(
    dy: jax.Array, w: jax.Array, w_scale: jax.Array, *,
    out_dtype: jax.typing.DTypeLike = jnp.bfloat16, impl: Impl = "auto",
    config: TuningConfig | None = None,
) -> jax.Array:
    """Data gradient ``dx = dy · W`` of ``y = x · Wᵀ`` with the blockwise recipe.

    ``dy`` (high precision, ``[..., M, N]``) is quantized 1x128 along N (fresh, per
    DeepSeek-V3); W's 128x128 blocks transpose cleanly, so ``Wᵀ`` needs no re-quantization:

        dy_q, dy_s = quantize_1x128(dy)
        dx = blockwise_fp8_matmul(dy_q, dy_s, w.T, w_scale.T)      # B = Wᵀ: [K, N], N-major

    Args:
      dy: floating ``[..., M, N]``; N must be divisible by 128 (it is the contraction dim).
      w: float8_e4m3fn ``[N, K]``, the forward's quantized weight.
      w_scale: float32 ``[N/128, K/128]``.
      out_dtype: as ``blockwise_fp8_matmul``.
      impl: as ``blockwise_fp8_matmul``.
      config: as ``blockwise_fp8_matmul``.

    Returns:
      ``dx``, ``[..., M, K]`` of ``out_dtype``.

    Raises:
      ValueError: w is not 2-D or N is not divisible by 128; and as ``quantize_1x128`` and
        ``blockwise_fp8_matmul``.
    """
    if not hasattr(w, "shape") or w.ndim != 2:
        raise ValueError(f"w must be 2-D [N, K], got {getattr(w, 'shape', type(w))}.")
    if w.shape[0] % BLOCK_K:
        raise ValueError(f"n={w.shape[0]} (w.shape[0], the contraction dim of dgrad) must be "
                         f"divisible by block_k={BLOCK_K}.")
    dy_q, dy_s = quantize_1x128(dy, impl=impl)
    return blockwise_fp8_matmul(dy_q, dy_s, w.T, w_scale.T, out_dtype=out_dtype, impl=impl,
                                config=config)


@functools.partial(jax.jit, static_argnames=("out_dtype", "impl", "config"))
def blockwise_fp8_wgrad(
    dy: jax.Array, x: jax.Array, *, out_dtype: jax.typing.DTypeLike = jnp.float32,
    impl: Impl = "auto", config: TuningConfig | None = None,
) -> jax.Array:
    """Weight gradient ``dW = dyᵀ · x`` (``[N, K]``, the layout of W) with the same kernel.

    The contraction runs over the tokens (M), so both operands are re-quantized from high
    precision along M, 1x128 each (DeepSeek-V3's 128x1 tiles of dy and x; DeepGEMM's
    "1D1D" weight-gradient GEMM), B with per-row scales:

        g_q, g_s = quantize_1x128(dy.T)          # A = dyᵀ [N, M], scales [N, M/128]
        x_q, x_s = quantize_1x128(x.T)           # B = xᵀ  [K, M], scales [K, M/128]
        dW = blockwise_fp8_matmul(g_q, g_s, x_q, x_s, out_dtype=jnp.float32)

    M is zero-padded to a multiple of 128 (zero tokens add nothing).

    Args:
      dy: floating ``[M, N]`` (flatten leading dims first).
      x: floating ``[M, K]``, the forward's high-precision input.
      out_dtype: float32 (default; weight gradients accumulate in f32) or bfloat16.
      impl: as ``blockwise_fp8_matmul``.
      config: as ``blockwise_fp8_matmul``.

    Returns:
      ``dW``, ``[N, K]`` of ``out_dtype``.

    Raises:
      ValueError: dy or x is not 2-D, or their token counts differ.
    """
    for name, t in (("dy", dy), ("x", x)):
        if not hasattr(t, "shape") or t.ndim != 2:
            raise ValueError(f"{name} must be 2-D [M, ...], got {getattr(t, 'shape', t)}.")
    if dy.shape[0] != x.shape[0]:
        raise ValueError(f"dy.shape[0]={dy.shape[0]} and x.shape[0]={x.shape[0]} (tokens) "
                         f"must match.")
    m = dy.shape[0]
    mp = pl.cdiv(m, BLOCK_K) * BLOCK_K
    if mp != m:
        dy = jnp.pad(dy, ((0, mp - m), (0, 0)))
        x = jnp.pad(x, ((0, mp - m), (0, 0)))
    g_q, g_s = quantize_1x128(dy.T, impl=impl)
    x_q, x_s = quantize_1x128(x.T, impl=impl)
    return blockwise_fp8_matmul(g_q, g_s, x_q, x_s, out_dtype=out_dtype, impl=impl,
                                config=config)
