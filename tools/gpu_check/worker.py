"""A worker process: runs the items of one phase in order, in a process the watcher can kill.

A worker imports JAX and initializes its backend (the watcher never does); under
``--cpu-rehearsal`` it runs on the CPU, the kernels in GPU-interpret mode, at tiny shapes.
"""

from __future__ import annotations

import dataclasses
import os
import time
import traceback
from collections.abc import Callable
from pathlib import Path

from tools.gpu_check.bench import BENCH_ROUNDS, PRODUCTION_SHAPES, bench_shape
from tools.gpu_check.compilation import COMPILE_SHAPE, compile_kernel, environment
from tools.gpu_check.correctness import check_gradients, check_matmul, check_quantizers
from tools.gpu_check.files import record, write_json
from tools.gpu_check.grouped import grouped_items
from tools.gpu_check.optimizer import optax_chain
from tools.gpu_check.per_tensor import PER_TENSOR_SHAPE, per_tensor_gemms
from tools.gpu_check.profile import profile_items
from tools.gpu_check.train import train_step
from tools.gpu_check.tune import (
    FORM_ROUNDS,
    FORM_SHAPES,
    TUNE_ROUNDS,
    TUNE_SHAPES,
    compare_forms,
    form_configs,
    tune_shape,
)

__all__ = ["PHASES", "phase_items", "run_worker"]

PHASES = ("compile", "correctness", "bench", "train", "tune", "profile", "pytest")
"""The phases, in the order they run (``pytest`` runs in the watcher, not in a worker)."""


def phase_items(phase: str, *, rehearsal: bool, work: Path, excluded: set[str]
                ) -> list[tuple[str, Callable[[], dict]]]:
    """(name, thunk) pairs of a phase, in the order they run."""
    from pallas_kernels import num_sms
    from pallas_kernels.config import SHIPPED_CONFIGS, choose_config

    impl = "interpret" if rehearsal else "kernel"
    configs = [c for c in SHIPPED_CONFIGS.values() if str(c) not in excluded]
    if rehearsal:  # two configs, one per form, at tiny shapes: the same code, on CPU
        configs = [c for c in configs if str(c) in (str(SHIPPED_CONFIGS["128x128"]),
                                                    str(SHIPPED_CONFIGS["256x128"]))]

    def chosen(m, n, k):
        """choose_config, or the first config that passed the compile phase."""
        cfg = choose_config(m, n, k, "bfloat16", num_sms("kernel"))
        return cfg if str(cfg) not in excluded or not configs else configs[0]

    # Rehearsal shapes: the smallest that still take the N-tail path (N = 1.5 tiles) and
    # wrap nothing; GPU-interpret mode costs ~0.5-2 s a call on a loaded CPU.
    shapes = ((128, 192, 256),) if rehearsal else PRODUCTION_SHAPES
    tiny = (128, 128, 128)
    items: list[tuple[str, Callable[[], dict]]] = []
    if phase == "compile":
        items.append(("env", environment))
        m, n, k = tiny if rehearsal else COMPILE_SHAPE
        forms = (("bfloat16", False), ("float32", True))
        for i, cfg in enumerate(configs):
            # rehearsal: one form per config (128x128 forward, 256x128 weight gradient)
            for dt, b_rows in forms[i:i + 1] if rehearsal else forms:
                items.append((f"kernel-{cfg}-{dt}{'-brows' if b_rows else ''}",
                              lambda cfg=cfg, dt=dt, b_rows=b_rows: compile_kernel(
                                  m, n, k, impl=impl, config=cfg, out_dtype=dt,
                                  b_rows=b_rows)))
    elif phase == "correctness":
        for m, n, k in shapes:
            items.append((f"matmul-{m}x{n}x{k}", lambda m=m, n=n, k=k: check_matmul(
                m, n, k, impl=impl, config=chosen(m, n, k))))
        g = tiny if rehearsal else (4096, 7168, 2048)
        items.append((f"gradients-{'x'.join(map(str, g))}",
                      lambda: check_gradients(*g, impl=impl)))
        q = (256, 256) if rehearsal else (4096, 7168)
        items.append((f"quantizers-{q[0]}x{q[1]}", lambda: check_quantizers(
            impl, shape=q, pow2s=(False,) if rehearsal else (False, True))))
    elif phase == "bench":
        rounds = 2 if rehearsal else BENCH_ROUNDS
        for m, n, k in (tiny,) if rehearsal else shapes:
            items.append((f"{m}x{n}x{k}", lambda m=m, n=n, k=k: bench_shape(
                m, n, k, impl=impl, config=chosen(m, n, k), rounds=rounds,
                rehearsal=rehearsal)))
        p = tiny if rehearsal else PER_TENSOR_SHAPE
        items.append(("fp8-per-tensor", lambda: per_tensor_gemms(*p, rounds=rounds,
                                                                  rehearsal=rehearsal)))
    elif phase == "train":
        items.append(("llama-step", lambda: train_step(work, rehearsal, model="llama")))
        items.append(("transformer-step", lambda: train_step(work, rehearsal)))
        items.append(("optax-chain", lambda: optax_chain(rehearsal=rehearsal)))
    elif phase == "tune":
        rounds = 1 if rehearsal else TUNE_ROUNDS
        for m, n, k in (tiny,) if rehearsal else TUNE_SHAPES:
            items.append((f"{m}x{n}x{k}", lambda m=m, n=n, k=k: tune_shape(
                m, n, k, impl=impl, configs=configs, rounds=rounds, rehearsal=rehearsal)))
        if rehearsal:  # one shape, tiles split along M (interpret mode: see kernels.md)
            from pallas_kernels.config import TuningConfig, with_scales

            base = SHIPPED_CONFIGS["128x128"]
            variants = {"default": base, "smem_scales": with_scales(base, "smem"),
                        "128x144": with_scales(TuningConfig(128, 144, "m", 1), "global"),
                        "tile_epilogue": form_configs(128, 304, 256, "bfloat16",
                                                      base=base)["tile_epilogue"],
                        "cluster": dataclasses.replace(base, cluster=(2, 1))}
            items.append(("forms-128x304x256", lambda: compare_forms(
                128, 304, 256, out_dtype="bfloat16", b_rows=False, impl=impl, base=base,
                rounds=1, rehearsal=True, variants=variants)))
        else:
            for m, n, k, dt, b_rows in FORM_SHAPES:
                items.append((f"forms-{m}x{n}x{k}-{dt}{'-brows' if b_rows else ''}",
                              lambda m=m, n=n, k=k, dt=dt, b_rows=b_rows: compare_forms(
                                  m, n, k, out_dtype=dt, b_rows=b_rows, impl=impl,
                                  base=chosen(m, n, k), rounds=FORM_ROUNDS,
                                  rehearsal=False)))
    elif phase == "profile":
        items += profile_items(rehearsal=rehearsal, work=work)
    else:
        raise ValueError(f"phase must be one of {PHASES[:-1]}, got {phase!r}.")
    return items + grouped_items(phase, rehearsal=rehearsal, impl=impl)


def run_worker(phase: str, work: Path, deadline_at: float, skip: set[str], rehearsal: bool,
               excluded: set[str]) -> int:
    """Runs the items of ``phase`` in order (but those in ``skip``), writing which item is in
    progress (``PHASE.progress.json``, what the watcher's watchdog reads) and each result
    (``PHASE.json``) as it goes; the items left when ``deadline_at`` passes are recorded as
    skipped. Returns 0."""
    import jax

    if rehearsal:
        jax.config.update("jax_platforms", "cpu")
    results_file = work / f"{phase}.json"
    progress_file = work / f"{phase}.progress.json"
    items = phase_items(phase, rehearsal=rehearsal, work=work, excluded=excluded)
    for name, thunk in items:
        if name in skip:
            continue
        if time.time() > deadline_at:
            record(results_file, name, {"skipped": "the phase's time ran out"})
            continue
        write_json(progress_file, {"item": name, "started": time.time(), "pid": os.getpid()})
        print(f"[{phase}] {name} ...", flush=True)
        t0 = time.perf_counter()
        try:
            result = thunk()
        except Exception:  # record and go on: the next items may still tell us something
            result = {"ok": False, "error": traceback.format_exc()[-4000:]}
        result = {"item_seconds": round(time.perf_counter() - t0, 3), **result}
        record(results_file, name, result)
        print(f"[{phase}] {name}: {'ok' if result.get('ok') else 'FAILED'} "
              f"({result['item_seconds']:.1f} s)", flush=True)
        if name == "env" and not result.get("hopper") and not rehearsal:
            break  # nothing to compile here; the watcher reports it
    write_json(progress_file, {"item": None, "done": True})
    return 0
