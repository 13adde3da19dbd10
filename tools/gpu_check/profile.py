"""The ``profile`` phase: one run of the blockwise FP8 kernel under Mosaic GPU's intra-kernel
profiler, reduced to a per-warpgroup summary of its K loop.

Mosaic GPU (jax 0.11.2) profiles a kernel built with ``plgpu.CompilerParams(profile_space=N,
profile_dir=DIR)``: every ``jax.named_scope`` in the kernel body becomes a region whose
entry and exit the first thread of each warpgroup stamps with the SM clock (``%clock``)
into shared memory (``jax.experimental.mosaic.gpu.profiler.OnDeviceProfiler.record``; the
launch itself adds an ``Init`` region); after the run a ``jax.debug.callback`` writes one
Chrome trace per kernel call into DIR (``ProfilerSpec.dump``, called by Pallas's Mosaic GPU
``pallas_call`` lowering). The kernel body has no named
scopes of its own, so ``profiled`` adds them from outside while the kernel is traced: it
wraps the two public entry points the kernel calls, ``plgpu.kernel`` (to pass the
profiler's compiler params) and ``plgpu.emit_pipeline_warp_specialized`` (a ``k_step``
region around the compute warpgroups' body, one per K block, and a ``tile`` region around
each output tile's pipeline, on all three warpgroups). The body is left as it ships.

``ProfilerSpec.dump``'s format, which ``reduce_trace`` reads: ``{"displayTimeUnit": "ns",
"traceEvents": [...]}``, per region one ``"ph": "B"`` and one ``"ph": "E"`` event with
``name``, ``pid`` (1 + the SM), ``tid`` (1 + warpgroup + 3 x CTA: one trace per warpgroup)
and ``ts`` = (the warpgroup's start ``globaltimer`` in ns + its ``%clock`` cycles since its
first event, less the profiler's own per-event cost) / 1e3. Within one trace a ``ts``
difference of 1 is therefore 1000 SM clock cycles: the summary is in cycles. The traces of
a warpgroup are written in order (no interleaving), its clock strictly increasing.

The warpgroups of a CTA: 0 and 1 compute (``consumer0``, ``consumer1``), 2 issues the TMA
copies (``producer``: ``emit_pipeline_warp_specialized``'s memory warpgroup is the one
after the compute warpgroups). The profiler's buffer holds the regions per warpgroup that
the kernel's shared memory leaves room for (``fit_profile``: at most ``PROFILE_SPACE``);
later ones are dropped (``profile_bounds_check``), so the trace covers the start of each
CTA's first output tile: its whole K loop where the room allows, else its first K steps
(``truncated``: the writer then closes the open ``tile`` region at the last event, and its
duration is only that far).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import shutil
import statistics
from pathlib import Path
from typing import Any

__all__ = ["MIN_PROFILE_SPACE", "PROFILE_SHAPES", "PROFILE_SPACE", "ROLES", "copy_traces",
           "fit_profile", "profile_items", "profile_kernel", "profiled", "reduce_trace",
           "synthetic_trace", "was_cut"]

# (item, M, N, K, output dtype, B scaled per row): the forward GEMM at DeepSeek-V3's
# 4096 x 7168 x 16384 and the weight-gradient form (f32 out) at 7168 x 2112 x 4096.
PROFILE_SHAPES = (("forward-4096x7168x16384", 4096, 7168, 16384, "bfloat16", False),
                  ("wgrad-7168x2112x4096", 7168, 2112, 4096, "float32", True))
# Regions per warpgroup at most: the first tile's K loop at K = 16384 (128 K steps), its
# tile and Init regions, and room to spare (3 warpgroups x 160 x 16 B = 7.5 KiB).
PROFILE_SPACE = 160
MIN_PROFILE_SPACE = 16  # fewer regions than this say nothing of a K loop: cut a stage instead
ROLES = ("consumer0", "consumer1", "producer")
TILE, K_STEP = "tile", "k_step"
_CYCLES_PER_TS = 1e3  # ProfilerSpec.dump divides globaltimer ns + clock cycles by 1e3
_TRACE_DIR = "profile"  # under the worker's work folder; copy_traces moves them out


def reduce_trace(trace: dict) -> dict:
    """The per-warpgroup summary of a Mosaic GPU profiler trace (module docstring).

    Per role (warpgroup index in the CTA, ``ROLES``): its traces, their spans (first to last
    event, summed and median, in SM cycles), the most events in one of them, and per region
    name the count, the total and
    median duration in cycles, and ``share``: the total over the summed spans.

    Raises:
      ValueError: ``trace`` has no ``traceEvents`` list, an event's ``ph`` is not "B" or
        "E", or a trace's regions do not nest (an end without its begin, or one left open).
    """
    events = trace.get("traceEvents") if isinstance(trace, dict) else None
    if not isinstance(events, list):
        raise ValueError("trace must be a dict with a 'traceEvents' list (the format of "
                         "jax.experimental.mosaic.gpu.profiler.ProfilerSpec.dump).")
    per_tid: dict[int, list[dict]] = {}
    for ev in events:
        if ev.get("ph") not in ("B", "E"):
            raise ValueError(f"trace event ph must be 'B' or 'E', got {ev.get('ph')!r}.")
        per_tid.setdefault(int(ev["tid"]), []).append(ev)
    roles: dict[str, dict[str, Any]] = {}
    for tid, evs in sorted(per_tid.items()):
        role = ROLES[(tid - 1) % len(ROLES)]  # tid = 1 + warpgroup + 3 x CTA
        r = roles.setdefault(role, {"spans": [], "regions": {}})
        stack: list[tuple[str, float]] = []
        for ev in evs:
            if ev["ph"] == "B":
                stack.append((ev["name"], float(ev["ts"])))
                continue
            if not stack or stack[-1][0] != ev["name"]:
                raise ValueError(f"trace tid {tid}: end of {ev['name']!r} without its begin.")
            name, begin = stack.pop()
            r["regions"].setdefault(name, []).append(
                (float(ev["ts"]) - begin) * _CYCLES_PER_TS)
        if stack:
            raise ValueError(f"trace tid {tid}: regions {[n for n, _ in stack]} left open.")
        r["spans"].append((float(evs[-1]["ts"]) - float(evs[0]["ts"])) * _CYCLES_PER_TS)
        r["most"] = max(r.get("most", 0), len(evs))
    out = {}
    for role, r in sorted(roles.items()):
        span = sum(r["spans"])
        out[role] = {
            "traces": len(r["spans"]), "span_cycles_total": round(span),
            "span_cycles_median": round(statistics.median(r["spans"])),
            "events_per_trace_max": r["most"],
            "regions": {name: {"count": len(d), "total_cycles": round(sum(d)),
                               "median_cycles": round(statistics.median(d)),
                               "share": round(sum(d) / span, 6) if span else None}
                        for name, d in sorted(r["regions"].items())}}
    return {"unit": "SM clock cycles", "roles": out}


def was_cut(summary: dict, space: int) -> bool:
    """Whether a trace of ``reduce_trace``'s ``summary``, recorded with ``space`` regions per
    warpgroup, may have been cut: a full buffer holds 2 * space - 2 events after its
    3-entry header (the bounds check of ``OnDeviceProfiler.record``) and the writer only
    adds events (the ends of regions a cut left open), so a trace with that many was cut
    (or ended just there)."""
    return max(r["events_per_trace_max"] for r in summary["roles"].values()) >= 2 * space - 2


@contextlib.contextmanager
def profiled(profile_dir: Path, space: int = PROFILE_SPACE):
    """While open, every Mosaic GPU kernel traced is built with the profiler on (traces into
    ``profile_dir``, ``space`` regions per warpgroup, later ones dropped) and its
    warp-specialized pipelines carry the ``tile`` and ``k_step`` regions (module docstring).
    JAX's caches are cleared on entry and exit, so the kernel is traced anew both ways.
    Yields a dict counting the hooks' calls (``kernels``, ``pipelines``, ``k_steps``) as the
    kernel is traced: zeros mean the kernel no longer reaches them.
    """
    from unittest import mock

    import jax
    import jax.experimental.pallas.mosaic_gpu as plgpu

    params = plgpu.CompilerParams(profile_space=space, profile_dir=str(profile_dir),
                                  profile_bounds_check=True)
    kernel, emit = plgpu.kernel, plgpu.emit_pipeline_warp_specialized
    calls = {"kernels": 0, "pipelines": 0, "k_steps": 0}

    def kernel_(*args, compiler_params=None, **kwargs):
        calls["kernels"] += 1
        cp = params if compiler_params is None else dataclasses.replace(
            compiler_params, profile_space=space, profile_dir=str(profile_dir),
            profile_bounds_check=True)
        return kernel(*args, compiler_params=cp, **kwargs)

    def emit_(body, *args, **kwargs):
        def body_(*a, **kw):
            calls["k_steps"] += 1
            with jax.named_scope(K_STEP):
                return body(*a, **kw)

        pipeline = emit(body_, *args, **kwargs)

        @functools.wraps(pipeline)  # keeps its get_allocations
        def pipeline_(*a, **kw):
            calls["pipelines"] += 1
            with jax.named_scope(TILE):
                return pipeline(*a, **kw)

        return pipeline_

    jax.clear_caches()
    try:
        with mock.patch.object(plgpu, "kernel", kernel_), \
                mock.patch.object(plgpu, "emit_pipeline_warp_specialized", emit_):
            yield calls
    finally:
        jax.clear_caches()


def synthetic_trace(path: Path) -> dict:
    """A trace written by the installed writer (``ProfilerSpec.dump``) from a hand-built
    profile buffer of two CTAs of three warpgroups: per compute warpgroup an ``Init``
    region of 100 cycles, then a ``tile`` region holding four ``k_step`` regions of 1000
    cycles 200 apart; the producer an ``Init`` of 100 and a ``tile`` of 4900 cycles. The
    CPU rehearsal's stand-in for a GPU run; returns what the writer wrote."""
    import numpy as np
    from jax.experimental.mosaic.gpu import profiler

    spec = profiler.ProfilerSpec(PROFILE_SPACE * 4)
    init, tile, k_step = (spec.intern_name(n) for n in ("Init", TILE, K_STEP))
    b, e = profiler.ProfilerSpec.ENTER, profiler.ProfilerSpec.EXIT

    def stamps(wg: int) -> list[tuple[int, int]]:
        # (tag, clock); the Init end and the tile begin 1 cycle apart, so the writer's
        # estimate of its own per-event cost (the least gap, less 1) is 0.
        ev = [(b | init, 0), (e | init, 100), (b | tile, 101)]
        if wg == 2:
            return [*ev, (e | tile, 5001)]
        for i in range(4):
            t0 = 301 + 1200 * i
            ev += [(b | k_step, t0), (e | k_step, t0 + 1000)]
        return [*ev, (e | tile, 5001)]

    buf = np.zeros((2, 3, spec.entries_per_warpgroup), np.uint32)
    for cta, wg in np.ndindex(2, 3):
        ev = stamps(wg)
        buf[cta, wg, :3] = (1_000_000 * (cta + 1), 7 + cta, 2 * len(ev))
        buf[cta, wg, 3:3 + 2 * len(ev)] = np.array(ev, np.uint32).ravel()
    with open(path, "w") as f:
        spec.dump(buf.ravel(), f, grid=(2,), block=(384,))
    return json.loads(path.read_text())


def fit_profile(m: int, n: int, k: int, out_dtype: str, b_rows: bool):
    """(config, space): the config the kernel chooses at this shape and the regions per
    warpgroup its shared memory leaves room for (Mosaic GPU puts the profiler's buffer, 3
    warpgroups x 16 bytes a region, 8-byte aligned, after the kernel's own; at most
    ``PROFILE_SPACE``). Only where that is under ``MIN_PROFILE_SPACE`` are the config's
    stages cut (then the profile is of a shallower pipeline than the one that ships)."""
    from pallas_kernels import num_sms
    from pallas_kernels.config import (
        BLOCK_K,
        SMEM_BYTES_H200,
        choose_config,
        pipeline_stages,
        smem_bytes,
    )

    cfg = choose_config(m, n, k, out_dtype, num_sms("kernel"), b_rows=b_rows)
    while True:
        stages, _ = pipeline_stages(cfg, k // BLOCK_K)
        start = -(-smem_bytes(cfg, out_dtype, stages) // 8) * 8
        space = (SMEM_BYTES_H200 - start) // (3 * 16)
        if space >= MIN_PROFILE_SPACE or stages == 1:
            return cfg, min(space, PROFILE_SPACE)
        cfg = dataclasses.replace(cfg, max_concurrent_steps=stages - 1)


def profile_kernel(name: str, m: int, n: int, k: int, out_dtype: str, b_rows: bool, *,
                   work: Path, rehearsal: bool) -> dict:
    """One profiled run of the kernel at (m, n, k), its trace kept as
    ``work/profile/NAME.trace.json`` and reduced (``reduce_trace``). On CPU (the
    rehearsal) the kernel runs in interpret mode at a tiny shape under ``profiled`` (the
    hooks must still be reached; no trace comes out of it), and the reduction runs on
    ``synthetic_trace``."""
    import jax

    from pallas_kernels import blockwise_fp8_matmul
    from pallas_kernels.bench import make_operands
    from pallas_kernels.quantize import quantize_1x128_reference

    out_dir = work / _TRACE_DIR
    raw = out_dir / "raw" / name
    raw.mkdir(parents=True, exist_ok=True)
    if rehearsal:
        m, n, k = 128, 128, 256
    cfg, space = fit_profile(m, n, k, out_dtype, b_rows)
    ops = make_operands(m, n, k)
    # The weight-gradient form: B re-quantized per 1x128 tile (one scale per row and block).
    wq, ws = quantize_1x128_reference(ops["w"]) if b_rows else (ops["wq"], ops["ws"])
    with profiled(raw, space) as calls:
        out = blockwise_fp8_matmul(ops["xq"], ops["xs"], wq, ws, out_dtype=out_dtype,
                                   impl="interpret" if rehearsal else "kernel", config=cfg)
        jax.block_until_ready(out)
        jax.effects_barrier()  # the trace is written by a debug callback
    trace_file = out_dir / f"{name}.trace.json"
    if rehearsal:
        trace = synthetic_trace(trace_file)
    else:
        files = sorted(raw.glob("*.json"))
        if len(files) != 1:
            return {"ok": False, "hooks": calls,
                    "error": f"expected one trace from the profiler, found {len(files)}"}
        shutil.move(files[0], trace_file)
        trace = json.loads(trace_file.read_text())
    summary = reduce_trace(trace)
    consumers = [summary["roles"].get(r, {}).get("regions", {}) for r in ROLES[:2]]
    ok = all(calls.values()) and all(K_STEP in c for c in consumers)
    return {"shape": [m, n, k], "out_dtype": out_dtype, "b_rows": b_rows,
            "config": str(cfg), "profile_space": space, "k_blocks": k // 128,
            "truncated": was_cut(summary, space), "hooks": calls, "trace": trace_file.name,
            "synthetic_trace": rehearsal, **summary, "ok": bool(ok)}


def profile_items(*, rehearsal: bool, work: Path) -> list:
    """The phase's (name, thunk) pairs: one profiled run per ``PROFILE_SHAPES`` entry."""
    return [(s[0], lambda s=s: profile_kernel(*s, work=work, rehearsal=rehearsal))
            for s in PROFILE_SHAPES]


def copy_traces(work: Path, out_dir: Path) -> list[str]:
    """Moves the phase's traces beside the report (``OUTDIR/gpu_check_profile_NAME.json``,
    out of the log tarball: a few MB each); returns their names."""
    names = []
    for f in sorted((work / _TRACE_DIR).glob("*.trace.json")):
        dest = out_dir / f"gpu_check_profile_{f.name.removesuffix('.trace.json')}.json"
        shutil.move(f, dest)
        names.append(dest.name)
    shutil.rmtree(work / _TRACE_DIR / "raw", ignore_errors=True)
    return names
