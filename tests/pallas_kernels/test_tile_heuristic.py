"""The tile heuristic's cost model (``pallas_kernels.config.tile_cycles``: waves and L1 / L2
traffic) against the tile choices DeepGEMM publishes, and the choices it makes among the
tiles this kernel has.

DeepGEMM (deepseek-ai/DeepGEMM) picks its Hopper FP8 GEMM tiles with a cost model of waves
and L1 / L2 bytes (``csrc/jit_kernels/heuristics/sm90.hpp``) over BLOCK_M 64 / 128 (256 with
bf16 output), BLOCK_N in steps of 16 up to 192 for its 1D2D kernel (a width above 128 only
where its unrolling allows: ``n % (n - 128) == 0`` or ``128 % (n - 128) == 0``; never both
blocks above 128) and 2-CTA clusters multicasting one operand. Its README (section
"Unaligned block sizes", e.g. at commit a437e0b) publishes one choice with its reason: for
M = 256, N = 7168, BLOCK_M = 128 with BLOCK_N = 112 instead of 128, so that
(256 / 128) * (7168 / 112) = 128 of the 132 SMs work instead of (256 / 128) * (7168 / 128) =
112.
"""

import dataclasses
import math

import pytest

from pallas_kernels.config import SHIPPED_CONFIGS, choose_config, tile_cycles

SMS = 132


def _deepgemm_candidates(bf16_out=True):
    """(block_m, block_n, cluster) DeepGEMM's 1D2D kernel may use on an H100/H200 (the rules
    in the module docstring, in words from sm90.hpp)."""
    block_ms = (64, 128, 256) if bf16_out else (64, 128)
    block_ns = [n for n in range(16, 193, 16)
                if n <= 128 or n % (n - 128) == 0 or 128 % (n - 128) == 0]
    for cluster in ((1, 1), (2, 1), (1, 2)):
        for bm in block_ms:
            for bn in block_ns:
                if not (bm > 128 and bn > 128):
                    yield bm, bn, cluster


def _best(m, n, k, candidates, cost=tile_cycles):
    return min(candidates, key=lambda c: cost(m, n, k, c[0], c[1], cluster=c[2]))


def test_model_reproduces_deepgemms_published_unaligned_choice():
    for k in (7168, 2048):  # DeepSeek-V3's projections with N = 7168
        assert _best(256, 7168, k, _deepgemm_candidates()) == (128, 112, (1, 1))
    # The README's arithmetic: busy SMs with each width
    assert math.ceil(256 / 128) * math.ceil(7168 / 128) == 112
    assert math.ceil(256 / 128) * math.ceil(7168 / 112) == 128


def test_a_wave_blind_model_misses_the_published_choice():
    """Negative control: the same traffic without the last wave's fill prefers the widest
    tile (fewer bytes per FLOP); the wave term is what finds 112."""
    def wave_blind(m, n, k, bm, bn, cluster):
        tiles = math.ceil(m / bm) * math.ceil(n / bn)
        fill = tiles / (math.ceil(tiles / SMS) * SMS)
        return tile_cycles(m, n, k, bm, bn, cluster=cluster) * fill

    assert _best(256, 7168, 7168, _deepgemm_candidates(), wave_blind) != (128, 112, (1, 1))


def test_model_by_hand():
    """One value worked by hand: 4096 x 7168 x 2048, 128 x 128 tiles, bf16 out, 132 SMs.
    1792 tiles, 14 waves (fill 1792 / 1848). Per tile L2 bytes 2048 * 256 + 32768 = 557056,
    L1 bytes 2 * 2048 * 256 + 2 * 32768 = 1114112. L2: 1792 * 557056 / 6153.8 B per clock
    (the chip's cap, below 64 * 132) = 162216 clocks; L1: 1792 * 1114112 / (128 * 132) =
    118164; the larger over the fill: 167284."""
    assert tile_cycles(4096, 7168, 2048, 128, 128) == pytest.approx(
        1792 * 557056 / (8e6 / 1.3e3) / (1792 / 1848), rel=1e-9)
    assert tile_cycles(4096, 7168, 2048, 128, 128) == pytest.approx(167284, rel=1e-4)
    # multicast halves one operand's L2 bytes; a one-wave cluster is never chosen
    assert tile_cycles(4096, 7168, 2048, 128, 128, cluster=(2, 1)) < tile_cycles(
        4096, 7168, 2048, 128, 128)
    assert tile_cycles(256, 256, 2048, 128, 128, cluster=(2, 1)) == math.inf


# DeepSeek-V3's GEMMs at 4096 tokens (DeepGEMM's README table; 8192^3 beside them) and the
# shipped tile the heuristic takes for each. 128x256 has the fewest L2 bytes per FLOP of the
# tiles without spills; at N = 2112 it needs 3 waves of 288 tiles (73% full) where 128x128
# needs 5 of 544 (82%), and at 64 rows only the 64-row tiles do not compute padding.
SHAPES = {(4096, 7168, 16384): "128x256", (4096, 7168, 2048): "128x256",
          (4096, 24576, 1536): "128x256", (4096, 2112, 7168): "128x128",
          (4096, 4096, 7168): "128x256", (8192, 8192, 8192): "128x256",
          (64, 2112, 7168): "64x128", (64, 7168, 16384): "64x128"}


@pytest.mark.parametrize("shape", list(SHAPES), ids=lambda s: "x".join(map(str, s)))
def test_choice_among_the_kernels_tiles(shape):
    for out_dtype in ("bfloat16", "float32"):
        assert choose_config(*shape, out_dtype) == SHIPPED_CONFIGS[SHAPES[shape]]


@pytest.mark.parametrize("shape", [s for s in SHAPES if s[0] > 64],
                         ids=lambda s: "x".join(map(str, s)))
def test_deepgemms_own_choices_are_out_of_the_kernels_reach(shape):
    """What the model picks from DeepGEMM's candidates at the 4096-token shapes needs what
    the default heuristic does not offer: a 2-CTA cluster with TMA multicast (more than one
    wave; opt-in with ``clusters=True``, below), or a width that is not 128 or 256 columns
    (144-192 wide single-pass warpgroup tiles), or 256 rows with 128 columns (which spills
    in this kernel: its measured cost is 1.13x). So the heuristic's choice differs from
    DeepGEMM's wherever this holds."""
    bm, bn, cluster = _best(*shape, _deepgemm_candidates())
    shipped = {(c.block_m, c.block_n) for c in SHIPPED_CONFIGS.values()}
    assert cluster != (1, 1) or (bm, bn) not in shipped or (bm, bn) == (256, 128)


def test_weight_gradient_form_takes_only_tiles_that_do_not_spill():
    """B scaled per row (the weight gradient, f32 out): the two-pass warpgroup tiles
    (128x256, 256x128) spill thousands of bytes in that form (measured, ptxas), so the
    heuristic takes them only for the forward. At DeepSeek-V3's wgrad shape of the N = 2112
    projection (7168 x 2112 outputs over 4096 tokens) the forward's choice is 128x256 (the
    control: the filter changes the choice), the weight gradient's 128x128."""
    no_spill = {SHIPPED_CONFIGS[n] for n in ("128x128", "64x256", "64x128")}
    assert choose_config(7168, 2112, 4096, "float32") == SHIPPED_CONFIGS["128x256"]
    assert choose_config(7168, 2112, 4096, "float32", b_rows=True) == (
        SHIPPED_CONFIGS["128x128"])
    for shape in SHAPES:
        assert choose_config(*shape, "float32", b_rows=True) in no_spill


# Two-CTA clusters (``choose_config(..., clusters=True)``). DeepGEMM's model, over its own
# candidates, clusters every 4096-token shape (several waves) and multicasts the operand whose
# panel is the larger: A of its 256x128 tiles (cluster (1, 2)) or B of its 128 x 160-192
# tiles (cluster (2, 1); with f32 output 256 rows are not a candidate).
MULTI_WAVE = [s for s in SHAPES if s[0] > 64]


def _shared_panel(bm, bn, cluster):
    """(rows of the multicast operand's tile, rows of the other's): A's tile has ``bm``
    rows, B's ``bn``; cluster (2, 1) shares B, (1, 2) shares A."""
    return (bn, bm) if cluster == (2, 1) else (bm, bn)


@pytest.mark.parametrize("shape", MULTI_WAVE, ids=lambda s: "x".join(map(str, s)))
def test_clusters_multicast_the_larger_panel_as_deepgemm_does(shape):
    for bf16_out in (True, False):
        bm, bn, cluster = _best(*shape, _deepgemm_candidates(bf16_out))
        assert cluster != (1, 1)
        shared, other = _shared_panel(bm, bn, cluster)
        assert shared > other
    # The same model on DeepGEMM's 256x128 tile alone: multicast of A, as DeepGEMM does.
    costs = {c: tile_cycles(*shape, 256, 128, cluster=c) for c in ((1, 1), (2, 1), (1, 2))}
    assert min(costs, key=costs.get) == (1, 2)
    # The heuristic, asked for clusters, takes the kernel's own tile of the unclustered
    # choice (128x256 or 128x128) in a cluster that multicasts its larger (or equal) panel.
    for out_dtype in ("bfloat16", "float32"):
        cfg = choose_config(*shape, out_dtype, clusters=True)
        assert cfg.cluster != (1, 1)
        assert (cfg.block_m, cfg.block_n) == (SHIPPED_CONFIGS[SHAPES[shape]].block_m,
                                              SHIPPED_CONFIGS[SHAPES[shape]].block_n)
        shared, other = _shared_panel(cfg.block_m, cfg.block_n, cfg.cluster)
        assert shared >= other


@pytest.mark.parametrize("shape", [(4096, 7168, 7168), (8192, 8192, 8192)],
                         ids=lambda s: "x".join(map(str, s)))
def test_cluster_choice_at_deepgemms_shapes(shape):
    """128x256 tiles at N = 7168 and 8192^3: B's 256-row panel is multicast along M
    (cluster (2, 1)); the mirror of DeepGEMM's 256x128 tiles multicasting A."""
    assert choose_config(*shape, clusters=True) == dataclasses.replace(
        SHIPPED_CONFIGS["128x256"], cluster=(2, 1))


@pytest.mark.parametrize("shape", [(64, 2112, 7168), (64, 7168, 16384), (256, 7168, 7168),
                                   (128, 4096, 4096), (512, 2048, 4096)],
                         ids=lambda s: "x".join(map(str, s)))
def test_one_wave_never_gets_a_cluster(shape):
    """At most one wave on 132 SMs for every candidate tile: no cluster, and the choice
    is the unclustered heuristic's."""
    for out_dtype in ("bfloat16", "float32"):
        for b_rows in (False, True):
            cfg = choose_config(*shape, out_dtype, b_rows=b_rows, clusters=True)
            assert cfg.cluster == (1, 1)
            assert cfg == choose_config(*shape, out_dtype, b_rows=b_rows)


def test_clusters_are_off_by_default():
    """Unmeasured on a GPU: the default choice never clusters; the control is the same
    shape with ``clusters=True``."""
    for shape in SHAPES:
        assert choose_config(*shape).cluster == (1, 1)
    assert choose_config(8192, 8192, 8192, clusters=True).cluster == (2, 1)


def test_cluster_model_counts_the_tile_past_an_odd_edge():
    """Three tile rows in clusters of two along M make two clusters: four tile rows of
    work (the last cluster's second CTA computes a tile past M). By hand: 384 x 33792 x
    1024 on 128x128 tiles is 3 x 264 = 792 tiles, 6 waves of 132; clustered along M it is
    4 x 264 = 1056 tiles, 8 waves; along N 3 x 264 (264 is even), 6 waves."""
    plain = tile_cycles(384, 33792, 1024, 128, 128)
    along_m = tile_cycles(384, 33792, 1024, 128, 128, cluster=(2, 1))
    along_n = tile_cycles(384, 33792, 1024, 128, 128, cluster=(1, 2))
    l2 = 1024 * 256 + 128 * 128 * 2  # per tile, without multicast
    l2_bw = 8e6 / 1.3e3  # the chip's cap, below 64 B x 132 SMs per clock
    l1 = 2 * 1024 * 256 + 2 * 128 * 128 * 2
    assert plain == pytest.approx(max(792 * l2 / l2_bw, 792 * l1 / (128 * 132)), rel=1e-9)
    l2_mc = 1024 * (128 + 64) + 128 * 128 * 2  # one operand's bytes halved
    assert along_m == pytest.approx(max(1056 * l2_mc / l2_bw, 1056 * l1 / (128 * 132)),
                                    rel=1e-9)
    assert along_n == pytest.approx(max(792 * l2_mc / l2_bw, 792 * l1 / (128 * 132)),
                                    rel=1e-9)
    assert along_n < plain < along_m
