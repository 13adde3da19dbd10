"""Cross-lowering for the H200 on CPU: every shipped tile config at production shapes.

Lowering runs Mosaic GPU's own compiler passes, so it catches what interpret mode accepts
but the hardware would not: shared memory past 227 KiB, FP8 operands that are not K-major,
TMA copies narrower than 16 bytes, register layouts wgmma cannot take. About 0.5 s a case.
"""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import blockwise_fp8_matmul, quantize_1x128, quantize_128x128
from pallas_kernels.bench import DEFAULT_SHAPES
from pallas_kernels.config import (
    BLOCK_K,
    SHIPPED_CONFIGS,
    SMEM_BYTES_H200,
    WIDE_PASSES,
    TuningConfig,
    choose_config,
    chunks_per_tile,
    max_stages,
    pipeline_stages,
    smem_bytes,
    with_scales,
)

H200 = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", platform="gpu", num_cores=132)


def _lower_for_h200(fn, *args) -> str:
    mesh = jax.sharding.AbstractMesh((), (), abstract_device=H200)
    with jax.sharding.use_abstract_mesh(mesh):
        lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    return lowered.as_text()


def _matmul_args(m, n, k, b_rows=False):
    return (jax.ShapeDtypeStruct((m, k), jnp.float8_e4m3fn),
            jax.ShapeDtypeStruct((m, k // 128), jnp.float32),
            jax.ShapeDtypeStruct((n, k), jnp.float8_e4m3fn),
            jax.ShapeDtypeStruct((n if b_rows else -(-n // 128), k // 128), jnp.float32))


def _report(name, dtype, shape, config, b_rows=False):
    """The shared memory a lowering uses (shown with ``pytest -s``; the table is in
    docs/guides/kernels.md)."""
    stages, persistent = pipeline_stages(config, shape[2] // BLOCK_K)
    print(f"{name} {np.dtype(dtype).name} {'x'.join(map(str, shape))}"
          f"{' b-rows' if b_rows else ''}: {stages} stages "
          f"({'persistent' if persistent else 'drain per tile'}), smem "
          f"{smem_bytes(config, dtype, stages)} of {SMEM_BYTES_H200} bytes")


# Every shipped config at every production shape (the benchmark's: 4096^3, 8192^3 and
# DeepSeek-V3's four projections at M = 4096) in bf16, the training path's output; f32 at
# the two shapes whose K gives the most and fewest stages. About 3-5 s a case.
CASES = ([(name, jnp.bfloat16, shape) for name in SHIPPED_CONFIGS for shape in DEFAULT_SHAPES]
         + [(name, jnp.float32, shape) for name in SHIPPED_CONFIGS
            for shape in ((4096, 7168, 2048), (4096, 24576, 1536))])


@pytest.mark.parametrize("name,dtype,shape", CASES, ids=[
    f"{c[0]}-{np.dtype(c[1]).name}-{'x'.join(map(str, c[2]))}" for c in CASES])
def test_shipped_config_lowers_for_h200(name, dtype, shape):
    config = SHIPPED_CONFIGS[name]
    assert config.max_concurrent_steps == max_stages(config, dtype)  # the most that fit
    _report(name, dtype, shape, config)
    text = _lower_for_h200(
        functools.partial(blockwise_fp8_matmul, out_dtype=dtype, impl="kernel",
                          config=config), *_matmul_args(*shape))
    assert "mosaic_gpu" in text


@pytest.mark.parametrize("name", list(SHIPPED_CONFIGS))
def test_shipped_config_with_row_scaled_b_lowers_for_h200(name):
    """The weight-gradient form (B scaled per 1x128 tile, [N, K/128], f32 output) at the
    wgrad shape of DeepSeek-V3's (7168, 2048) projection: N=7168 outputs, K=2048 inputs,
    4096 tokens."""
    config = SHIPPED_CONFIGS[name]
    _report(name, jnp.float32, (7168, 2048, 4096), config, b_rows=True)
    text = _lower_for_h200(
        functools.partial(blockwise_fp8_matmul, out_dtype=jnp.float32, impl="kernel",
                          config=config), *_matmul_args(7168, 2048, 4096, b_rows=True))
    assert "mosaic_gpu" in text


def test_auto_picks_the_kernel_on_an_h200():
    text = _lower_for_h200(blockwise_fp8_matmul, *_matmul_args(4096, 7168, 2048))
    assert "mosaic_gpu" in text


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("name", list(SHIPPED_CONFIGS))
def test_one_more_stage_overflows_as_modelled(name, dtype):
    """Controls for the checks above: one stage more than fits is rejected by Mosaic GPU,
    which reports exactly the bytes ``smem_bytes`` predicts (so the stage counts are the
    most that fit, and the model is Mosaic's), with the config's own epilogue form."""
    config = SHIPPED_CONFIGS[name]
    bigger = dataclasses.replace(config, max_concurrent_steps=config.max_concurrent_steps + 1)
    want = smem_bytes(bigger, dtype)
    assert want > SMEM_BYTES_H200
    k = bigger.max_concurrent_steps * BLOCK_K  # as many K blocks as stages: all are used
    assert pipeline_stages(bigger, k // BLOCK_K)[0] == bigger.max_concurrent_steps
    with pytest.raises(ValueError, match=f"smem_bytes={want} > max_smem_bytes"):
        _lower_for_h200(functools.partial(blockwise_fp8_matmul, out_dtype=dtype,
                                          impl="kernel", config=bigger),
                        *_matmul_args(4096, 2048, k))


@pytest.mark.parametrize("power_of_two", [False, True])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("fn", [quantize_1x128, quantize_128x128],
                         ids=["1x128", "128x128"])
def test_quantizers_lower_for_h200(fn, dtype, power_of_two):
    text = _lower_for_h200(functools.partial(fn, power_of_two=power_of_two, impl="kernel"),
                           jax.ShapeDtypeStruct((4096, 7168), dtype))
    assert "mosaic_gpu" in text


def _sub_jaxprs(eqn):
    for val in eqn.params.values():
        for v in val if isinstance(val, (tuple, list)) else (val,):
            sub = getattr(v, "jaxpr", v)
            sub = getattr(sub, "jaxpr", sub) if not hasattr(sub, "eqns") else sub
            if hasattr(sub, "eqns"):
                yield sub


def _wgmma_windows(jaxpr):
    """The bodies of the ``run_scoped`` regions that issue a ``wgmma`` and read its
    accumulator (the read is the ``wgmma.wait_group``): issue to wait, in program order."""
    for eqn in jaxpr.eqns:
        for sub in _sub_jaxprs(eqn):
            names = [e.primitive.name for e in sub.eqns]
            if (eqn.primitive.name == "run_scoped" and "wgmma_ref" in names
                    and "wgmma_accumulator_deref_p" in names):
                yield sub
            else:
                yield from _wgmma_windows(sub)


@pytest.mark.parametrize("b_rows", [True, False], ids=["b-rows", "b-blocks"])
@pytest.mark.parametrize("name", list(SHIPPED_CONFIGS))
def test_scale_product_is_formed_after_the_wgmma_wait(name, b_rows):
    """Spill-safe ordering, checked in the kernel as Mosaic GPU lowers it (program order of
    the traced kernel): between a wgmma's issue and its wait only the next K block's scale
    *vectors* are loaded; no (64, pass_n) f32 value (the per-element scale product, 64
    registers a thread) is formed there, where it would be live beside the in-flight
    accumulator and the running sums (256x128's weight gradient: 128 + 64 + 64 > 232)."""
    config = SHIPPED_CONFIGS[name]
    mesh = jax.sharding.AbstractMesh((), (), abstract_device=H200)
    with jax.sharding.use_abstract_mesh(mesh):
        traced = jax.jit(functools.partial(
            blockwise_fp8_matmul, out_dtype=jnp.float32, impl="kernel", config=config)
        ).trace(*_matmul_args(1024, 1024, 1024, b_rows=b_rows))
    windows = list(_wgmma_windows(traced.jaxpr.jaxpr))
    # one window per pass of a K step, in each of the persistent loop's four pipelines
    assert windows and len(windows) % len(config.passes) == 0
    # The next K block's scale vectors are loaded inside the last pass's window (one step
    # early, while the wgmmas run).
    loads = [sum(e.primitive.name == "load" for e in w.eqns) for w in windows]
    # one A row-scale vector per pass; with b_rows, one B column-scale vector per column
    # offset of the passes
    b_vectors = len({pc for _, pc in config.passes}) if b_rows else 0
    assert max(loads) == len(config.passes) + b_vectors
    full = (64, config.pass_n)
    for window in windows:
        formed = [e.primitive.name for e in window.eqns
                  if e.primitive.name in ("mul", "broadcast_in_dim")
                  and any(tuple(v.aval.shape) == full for v in e.outvars)]
        assert formed == []


@pytest.mark.parametrize("b_rows", [False, True], ids=["b-blocks", "b-rows"])
def test_n_tail_pads_only_the_scales(b_rows):
    """N = 2112 (DeepSeek-V3's, 16.5 tiles of 128): B and the output are neither padded
    nor sliced (TMA zero-fills loads and clips stores past N), only the f32 scale rows
    are padded; the kernel writes the [M, 2112] output directly."""
    mesh = jax.sharding.AbstractMesh((), (), abstract_device=H200)
    with jax.sharding.use_abstract_mesh(mesh):
        traced = jax.jit(functools.partial(
            blockwise_fp8_matmul, out_dtype=jnp.bfloat16, impl="kernel",
            config=SHIPPED_CONFIGS["128x128"])).trace(*_matmul_args(4096, 2112, 7168, b_rows))
    eqns = []

    def walk(jaxpr):
        for e in jaxpr.eqns:
            eqns.append(e)
            for sub in _sub_jaxprs(e):
                if e.primitive.name not in ("mpmd_map", "pallas_call"):
                    walk(sub)

    walk(traced.jaxpr.jaxpr)
    padded = [str(e.outvars[0].aval) for e in eqns if e.primitive.name == "pad"]
    assert padded and all(p.startswith("float32[") for p in padded)
    assert not [e for e in eqns if e.primitive.name in ("slice", "dynamic_slice")]
    (kernel,) = [e for e in eqns if e.primitive.name in ("mpmd_map", "pallas_call")]
    assert kernel.outvars[0].aval.shape == (4096, 2112)


def _mosaic_modules(text_fn, *args):
    """The Mosaic GPU modules of a lowering for the H200, deserialized (the custom call
    carries them as versioned MLIR bytecode; Mosaic GPU's own ``mosaic_gpu-serde`` pass
    turns them back into its dialects)."""
    from jax.extend.mlir import ir, passmanager

    mesh = jax.sharding.AbstractMesh((), (), abstract_device=H200)
    with jax.sharding.use_abstract_mesh(mesh):
        module = jax.jit(text_fn).trace(*args).lower(
            lowering_platforms=("cuda",)).compiler_ir("stablehlo")
    ctx = module.context
    ctx.allow_unregistered_dialects = True
    out = []
    for op in _walk(module.operation):
        if op.name == "stablehlo.custom_call" and "mhlo.backend_config" in op.attributes:
            blob = op.attributes["mhlo.backend_config"]["module"].value_bytes
            with ctx:
                mod = ir.Module.parse(blob)
                passmanager.PassManager.parse(
                    "builtin.module(mosaic_gpu-serde{serialize=false})").run(mod.operation)
            out.append(mod)
    return out


def _walk(op):
    yield op
    for region in op.regions:
        for block in region.blocks:
            for inner in block.operations:
                yield from _walk(inner.operation)


def _k_loop_f32_loads(mod):
    """(shared, global) counts of f32 loads inside the K loops of a Mosaic GPU module: the
    ``scf.for`` loops that carry f32 vectors (the running sums of the promotion)."""
    shared = global_ = 0
    for op in _walk(mod.operation):
        if op.name != "scf.for" or not any("xf32>" in str(r.type) for r in op.results):
            continue
        for inner in _walk(op):
            if inner.name not in ("llvm.load", "memref.load", "vector.load"):
                continue
            if "f32" not in str(inner.results[0].type):
                continue
            src = str(inner.operands[0].type)
            if "ptr<3>" in src or "workgroup" in src:
                shared += 1
            else:
                global_ += 1
    return shared, global_


@pytest.mark.slow
@pytest.mark.parametrize("b_rows", [False, True], ids=["b-blocks", "b-rows"])
@pytest.mark.parametrize("name", ["128x256", "64x128", "128x144"])
def test_k_loop_reads_scales_from_shared_memory_only(name, b_rows):
    """The lowered Mosaic GPU module for the H200: inside the K loop every f32 load (the
    scales: nothing else f32 is loaded there) reads shared memory, B's block scales from
    the buffer staged once per tile (128x144: three blocks a pass); the earlier form
    (``scales="global"``, the negative control) loads them from global memory there."""
    shape = (4096, 2048, 2048)
    found = {}
    for scales in ("smem", "global"):
        base = (SHIPPED_CONFIGS[name] if name in SHIPPED_CONFIGS
                else TuningConfig(128, 144, "m", 1))
        config = with_scales(base, scales)
        (mod,) = _mosaic_modules(
            functools.partial(blockwise_fp8_matmul, out_dtype=jnp.float32, impl="kernel",
                              config=config), *_matmul_args(*shape, b_rows=b_rows))
        found[scales] = _k_loop_f32_loads(mod)
    assert found["smem"][0] > 0 and found["smem"][1] == 0
    assert found["global"][1] > 0


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SHIPPED_CONFIGS))
def test_staged_scales_one_more_stage_overflows_as_modelled(name):
    """The shipped tiles with the scales staged (``with_scales(.., "smem")``): the stages
    fit, and one more is refused by Mosaic GPU with exactly the bytes ``smem_bytes``
    predicts (the scale rings included)."""
    config = with_scales(SHIPPED_CONFIGS[name], "smem")
    for b_rows in (False, True):
        assert smem_bytes(config, jnp.float32, b_rows=b_rows) <= SMEM_BYTES_H200
    bigger = dataclasses.replace(config, max_concurrent_steps=config.max_concurrent_steps + 1)
    # The longest K the stages divide (B's block scales for all of K are staged per tile:
    # their buffer grows with K, up to 256 K blocks).
    k_blocks = 256 // bigger.max_concurrent_steps * bigger.max_concurrent_steps
    assert pipeline_stages(bigger, k_blocks)[0] == bigger.max_concurrent_steps
    # f32 output: the dtype that bounds the stages of the "tile" epilogue (64x128, 64x256)
    want = smem_bytes(bigger, jnp.float32, k_blocks=k_blocks)
    assert want > SMEM_BYTES_H200
    k = k_blocks * BLOCK_K
    with pytest.raises(ValueError, match=f"smem_bytes={want} > max_smem_bytes"):
        _lower_for_h200(functools.partial(blockwise_fp8_matmul, out_dtype=jnp.float32,
                                          impl="kernel", config=bigger),
                        *_matmul_args(4096, 2048, k))
    # The stages that fit lower at the longest K (256 K blocks: the largest buffer).
    text = _lower_for_h200(functools.partial(blockwise_fp8_matmul, out_dtype=jnp.float32,
                                             impl="kernel", config=config),
                           *_matmul_args(4096, 2048, 256 * BLOCK_K))
    assert "mosaic_gpu" in text


WIDE_CASES = [(w, scales, dtype, b_rows) for w in WIDE_PASSES for scales in ("global", "smem")
              for dtype in (jnp.bfloat16, jnp.float32) for b_rows in (False, True)]


@pytest.mark.slow
@pytest.mark.parametrize("width,scales,dtype,b_rows", WIDE_CASES, ids=[
    f"128x{c[0]}-{c[1]}-{np.dtype(c[2]).name}-{'b-rows' if c[3] else 'b-blocks'}"
    for c in WIDE_CASES])
def test_wide_tiles_lower_for_h200(width, scales, dtype, b_rows):
    """128xN CTA tiles of one 64xN pass per warpgroup, N = 144-192 (FP8 wgmma N, the
    epilogue's narrower staging slots and swizzles, B's block scales changing inside a
    pass) at N = 2112 with K = 7168: Mosaic GPU accepts them with the most stages
    ``with_scales`` finds, within the H200's shared memory."""
    config = with_scales(TuningConfig(128, width, "m", 1), scales)
    assert smem_bytes(config, dtype, b_rows=b_rows) <= SMEM_BYTES_H200
    text = _lower_for_h200(
        functools.partial(blockwise_fp8_matmul, out_dtype=dtype, impl="kernel",
                          config=config), *_matmul_args(4096, 2112, 7168, b_rows=b_rows))
    assert "mosaic_gpu" in text


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("name", list(SHIPPED_CONFIGS))
def test_tile_epilogue_stages_as_modelled(name, dtype):
    """Every tile with the "tile" epilogue (one staging slot per chunk of a warpgroup's
    tile: 8 KiB to 64 KiB a warpgroup) at the most stages ``max_stages`` finds for it: Mosaic
    GPU lowers it, and refuses one stage more with exactly the bytes ``smem_bytes``
    predicts (the staging model is Mosaic's for 1 to 8 slots)."""
    config = dataclasses.replace(SHIPPED_CONFIGS[name], epilogue="tile")
    config = dataclasses.replace(config, max_concurrent_steps=max_stages(config, dtype))
    bigger = dataclasses.replace(config, max_concurrent_steps=config.max_concurrent_steps + 1)
    want = smem_bytes(bigger, dtype)
    assert smem_bytes(config, dtype) <= SMEM_BYTES_H200 < want
    for cfg in (config, bigger):
        k = cfg.max_concurrent_steps * BLOCK_K  # as many K blocks as stages: all are used
        lower = functools.partial(_lower_for_h200, functools.partial(
            blockwise_fp8_matmul, out_dtype=dtype, impl="kernel", config=cfg),
            *_matmul_args(4096, 2048, k))
        if cfg is config:
            assert "mosaic_gpu" in lower()
        else:
            with pytest.raises(ValueError, match=f"smem_bytes={want} > max_smem_bytes"):
                lower()


def _store_events(mod) -> list[str]:
    """The output stores and their waits of a Mosaic GPU module in program order: "T" for
    a TMA store (``cp.async.bulk.tensor.global.shared``), "W<n>" for a wait until at most n
    bulk groups still read shared memory (``cp.async.bulk.wait_group.read``)."""
    events = []
    for op in _walk(mod.operation):
        if op.name == "nvvm.cp.async.bulk.tensor.global.shared.cta":
            events.append("T")
        elif op.name == "nvvm.cp.async.bulk.wait_group":
            assert "read" in op.attributes  # only the stores' reads are waited for
            events.append(f"W{op.attributes['group'].value}")
    return events


# (config, out dtype, K): a drain-per-tile kernel (one epilogue in the module) and a
# persistent one (START, STEADY, STOP and single-tile pipelines: four epilogues).
STORE_ORDER_CASES = [("256x128", jnp.bfloat16, 896), ("64x256", jnp.float32, 1024)]


@pytest.mark.slow
@pytest.mark.parametrize("name,dtype,k", STORE_ORDER_CASES,
                         ids=[f"{c[0]}-{np.dtype(c[1]).name}-k{c[2]}"
                              for c in STORE_ORDER_CASES])
def test_tile_epilogue_waits_only_before_its_next_writes(name, dtype, k):
    """In the lowered module of the "tile" epilogue, each epilogue is one wait for *all*
    earlier stores (``W0``) and then its tile's TMA stores back to back: no wait between
    or after them, so the only wait on a tile's stores is the next tile's (or the kernel's
    last). Negative control: the "chunks" epilogue of the same tile (four chunks a
    warpgroup) waits between its own stores."""
    found = {}
    for epilogue in ("tile", "chunks"):
        config = dataclasses.replace(SHIPPED_CONFIGS[name], epilogue=epilogue)
        config = dataclasses.replace(config, max_concurrent_steps=max_stages(config, dtype))
        (mod,) = _mosaic_modules(functools.partial(
            blockwise_fp8_matmul, out_dtype=dtype, impl="kernel", config=config),
            *_matmul_args(4096, 2048, k))
        events = _store_events(mod)
        epilogues = 4 if pipeline_stages(config, k // BLOCK_K)[1] else 1
        assert chunks_per_tile(config, dtype) == 4
        assert events.count("T") == epilogues * 4 and events[-1] == "W0"  # kernel's last
        found[epilogue] = (events, epilogues)
    events, epilogues = found["tile"]
    assert events == ["W0", *"TTTT"] * epilogues + ["W0"]
    assert found["chunks"][0][:4] == ["W1", "T", "W1", "T"]


# Two-CTA clusters: the clustered configs the heuristic asks for (``choose_config(...,
# clusters=True)``) at the production shapes, in the Mosaic GPU module for the H200.
_LAUNCH = re.compile(r"gpu\.launch async \[[^]]*\] (?:clusters\([^)]*\) in \(%\w+ = %c(\d+), "
                     r"%\w+ = %c(\d+), %\w+ = %c(\d+)\) )?blocks\([^)]*\) in \(%\w+ = %c(\d+),")
_TMA_LOAD = "nvvm.cp.async.bulk.tensor.shared.cluster.global"
_REMOTE_ARRIVE = "mbarrier.arrive.shared::cluster"


def _cluster_facts(config, shape, out_dtype=jnp.bfloat16):
    """(cluster dims or None, CTAs launched, multicast TMA loads, other TMA loads, remote
    barrier arrivals) of the lowered kernel."""
    (mod,) = _mosaic_modules(
        functools.partial(blockwise_fp8_matmul, out_dtype=out_dtype, impl="kernel",
                          config=config), *_matmul_args(*shape))
    text = str(mod)
    (launch,) = _LAUNCH.findall(text)
    cluster = None if not launch[0] else tuple(int(d) for d in launch[:3])
    loads = [line for line in text.splitlines() if _TMA_LOAD in line]
    multicast = sum("multicast_mask" in line for line in loads)
    return cluster, int(launch[3]), multicast, len(loads) - multicast, text.count(
        _REMOTE_ARRIVE)


def _multicast_operands(config, shape):
    """Which kernel operands ("a", "b") the kernel's TMA loads copy collectively over the
    cluster (from the traced kernel: ``copy_gmem_to_smem`` with ``collective_axes``; the
    source ref's shape names the operand, M != N here)."""
    m, n, _ = shape
    mesh = jax.sharding.AbstractMesh((), (), abstract_device=H200)
    with jax.sharding.use_abstract_mesh(mesh):
        traced = jax.jit(functools.partial(
            blockwise_fp8_matmul, impl="kernel", config=config)).trace(*_matmul_args(*shape))
    found = set()

    def walk(jaxpr):
        for e in jaxpr.eqns:
            if e.primitive.name == "copy_gmem_to_smem":
                rows = e.invars[0].aval.shape[0]
                name = {m: "a", n: "b"}[rows]
                found.add((name, tuple(e.params.get("collective_axes") or ())))
            for sub in _sub_jaxprs(e):
                walk(sub)

    walk(traced.jaxpr.jaxpr)
    return {name for name, axes in found if axes == ("cluster",)}


CLUSTER_SHAPES = [s for s in DEFAULT_SHAPES
                  if choose_config(*s, clusters=True).cluster != (1, 1)]


@pytest.mark.slow
@pytest.mark.parametrize("shape", CLUSTER_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_heuristics_clusters_lower_with_multicast(shape):
    """Where the heuristic asks for a cluster (several waves), the module launches clusters
    of two CTAs (132 CTAs: 66 clusters), the shared operand's TMA loads carry a multicast
    mask, and the consumed barriers are arrived on across the cluster; shared memory is
    within the H200's (Mosaic GPU accepts the stages, as modelled). Negative control: the
    same tile without the cluster has none of these."""
    config = choose_config(*shape, clusters=True)
    assert smem_bytes(config, jnp.bfloat16) <= SMEM_BYTES_H200
    cluster, ctas, multicast, plain, remote = _cluster_facts(config, shape)
    assert cluster == (2, 1, 1) and ctas == 132
    assert multicast > 0 and plain > 0 and remote > 0
    cluster, ctas, multicast, plain, remote = _cluster_facts(
        dataclasses.replace(config, cluster=(1, 1)), shape)
    assert cluster is None and ctas == 132
    assert multicast == 0 and plain > 0 and remote == 0


@pytest.mark.slow
@pytest.mark.parametrize("name,cluster,want", [
    ("128x256", (2, 1), {"b"}), ("256x128", (1, 2), {"a"}), ("128x128", (1, 1), set())])
def test_cluster_multicasts_the_shared_operand(name, cluster, want):
    """Clusters along M share (multicast) B's tile, along N A's; unclustered, neither."""
    config = dataclasses.replace(SHIPPED_CONFIGS[name], cluster=cluster)
    assert _multicast_operands(config, (4096, 7168, 2048)) == want


@pytest.mark.slow
@pytest.mark.parametrize("name,cluster", [("128x256", (2, 1)), ("256x128", (1, 2)),
                                          ("64x128", (2, 1))])
def test_clustered_one_more_stage_overflows_as_modelled(name, cluster):
    """A cluster changes no shared-memory allocation (its consumed barriers are cluster
    barriers of the same 8 bytes): the shipped stages fit, one more is refused with the
    bytes ``smem_bytes`` predicts."""
    config = dataclasses.replace(SHIPPED_CONFIGS[name], cluster=cluster)
    _lower_for_h200(functools.partial(blockwise_fp8_matmul, out_dtype=jnp.float32,
                                      impl="kernel", config=config),
                    *_matmul_args(4096, 2048, config.max_concurrent_steps * BLOCK_K))
    bigger = dataclasses.replace(config, max_concurrent_steps=config.max_concurrent_steps + 1)
    want = smem_bytes(bigger, jnp.float32)
    assert want > SMEM_BYTES_H200
    with pytest.raises(ValueError, match=f"smem_bytes={want} > max_smem_bytes"):
        _lower_for_h200(functools.partial(blockwise_fp8_matmul, out_dtype=jnp.float32,
                                          impl="kernel", config=bigger),
                        *_matmul_args(4096, 2048, bigger.max_concurrent_steps * BLOCK_K))
