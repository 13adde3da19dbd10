"""The one prepared GPU check of the blockwise FP8 kernels: the first command a GPU session runs.

    python -m pallas_kernels.gpu_check --out-dir runs/gpu-check        # ~5-8 min on an H200
    python -m pallas_kernels.gpu_check --cpu-rehearsal --out-dir /tmp/r  # the same, on CPU

Phases, in order of importance; each runs in its own subprocess, watched by this process:

1. ``smoke``: the device and versions, then every shipped config on a small multi-tile
   problem (4096x2048x1024: several output tiles per CTA, the shared-memory ring
   wrapped), the row-scaled (weight-gradient) form, both gradient GEMMs and the
   quantizers, compiled, against the pure-JAX reference. Compiled with
   ``MOSAIC_GPU_DUMP_PTXAS=1`` and ``MOSAIC_GPU_DUMP_RESOURCES=1``, so ptxas's
   register/spill report of each kernel lands in ``smoke.log`` (parsed into the report).
   Configs that fail here are left out of the later phases.
2. ``correctness``: the chosen config at the production shapes (f32 output against the
   reference, bf16 output at two shapes, DeepGEMM's criterion against the unquantized f32
   product), the gradient GEMMs at DeepSeek-V3's (7168, 2048) projection, and the
   quantizers bit for bit at 4096x7168.
3. ``bench``: per production shape the kernel (bf16 out) and XLA's bf16 ``jnp.dot`` timed on
   the device (CUPTI kernel timestamps, ``pallas_kernels.bench.device_times``), with the
   chosen config; TFLOP/s and the ratio.
4. ``tune``: every shipped config (bf16 out) at 8192^3 and 4096x7168x2048 (data for
   ``choose_config``).
5. ``pytest``: the compiled-mode kernel tests (``pytest -m gpu tests/pallas_kernels``).

Nothing can hang the window: every item (one config, one shape) runs under a timeout in a
worker subprocess that is killed with its process group when the item overruns, or when
its phase's share of the time left (``PHASE_SHARE``) or the global ``--deadline`` runs out
(checked by the watcher every 0.5 s, not between phases); after a hang or crash the worker
is restarted on the remaining items. Each item's result is written to
``<out-dir>/<phase>.json`` as soon as it exists, and ``<out-dir>/gpu_check.json`` collects
the phases, the ptxas report and a status after each phase. The watcher itself never
initializes a JAX backend (it would take the GPU's memory from the workers). Exit status 1
if a check failed or hung, 0 otherwise (also without a Hopper GPU, after saying so).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

# Compiled kernel vs reference, f32 output. Hopper's FP8 wgmma accumulates a 128-wide K
# block with fewer bits than f32 (about 14, DeepSeek-V3 §3.3.2) before the f32 promotion;
# the error budget per block partial is ~2^-14. 1e-3 is a loose first bound: this check
# records the measured values so the bound can be tightened.
F32_RTOL_GPU = 1e-3
BF16_RTOL = 2.0**-8  # the final bf16 rounding is <= 2^-9 per element
DEEPGEMM_DIFF = 1e-3  # DeepGEMM tests/test_core.py: calc_diff < 0.001
CHECK_SHAPES = ((4096, 4096, 4096), (8192, 8192, 8192), (4096, 7168, 2048),
                (4096, 2112, 7168), (4096, 24576, 1536), (4096, 7168, 16384))
BF16_SHAPES = ((4096, 7168, 2048), (4096, 2112, 7168))
# Several tiles per CTA for every config on 132 SMs (256 tiles of 256x128 or 128x256, 512 of
# 128x128, 1024 of 64x128) and 8 K blocks, which wrap every shipped ring at least once.
SMOKE_SHAPE = (4096, 2048, 1024)
TUNE_SHAPES = ((8192, 8192, 8192), (4096, 7168, 2048))
PHASES = ("smoke", "correctness", "bench", "tune", "pytest")
# Per-item limits (seconds): a Mosaic GPU compile takes seconds and every item runs one to
# three compiles and a few GEMMs of at most 1.1 TFLOP; minutes mean a hang.
ITEM_TIMEOUT_S = {"smoke": 90.0, "correctness": 120.0, "bench": 120.0, "tune": 90.0}
STARTUP_TIMEOUT_S = 120.0  # a worker that has not started its first item by then is stuck
MIN_PHASE_S = 20.0  # starting a worker (imports, backend) costs ~5-10 s: not worth it below
MAX_RESTARTS = 4  # per phase; each restart skips the item that hung or crashed
# Share of the time left that a phase may use (the rest stays for the later phases), so a
# slow correctness phase cannot eat the benchmark: with the default 480 s and phases that
# use their budget, smoke ~145 s, correctness ~135, bench ~140, tune ~35, pytest the rest.
PHASE_SHARE = {"smoke": 0.3, "correctness": 0.4, "bench": 0.7, "tune": 0.6}
_POLL_S = 0.5
_REPO = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------------------
# Checks (run in a worker; they import JAX).


def _rel_fro(x, ref) -> float:
    import jax.numpy as jnp

    x = x.astype(jnp.float32)
    ref = ref.astype(jnp.float32)
    return float(jnp.linalg.norm(x - ref) / jnp.linalg.norm(ref))


def _deepgemm_diff(x, y) -> float:
    import jax.numpy as jnp

    x = x.astype(jnp.float32)
    y = y.astype(jnp.float32)
    return float(jnp.sum((x - y) ** 2) / jnp.sum(x * x + y * y))


def _bits_equal(a, b) -> tuple[bool, int]:
    import numpy as np

    ua = np.asarray(a).view(np.uint8 if a.dtype.itemsize == 1 else np.uint32)
    ub = np.asarray(b).view(np.uint8 if b.dtype.itemsize == 1 else np.uint32)
    bad = int(np.sum(ua != ub))
    return bad == 0, bad


def _hard_input(rows: int, cols: int, dtype, seed: int):
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, cols)) * 2.0 ** rng.integers(-20, 20, (rows, cols))
    x[:128, :128] = 0.0
    x[128:130, 128:256] = 1e-40 if np.dtype(dtype) == np.float32 else 1e-30
    x[130, :128] = 3e38
    x[131, 256:384] = np.nan
    return jnp.asarray(x.astype(np.float32)).astype(dtype)


def check_quantizers(impl: str = "kernel", shape=(4096, 7168), dtypes=None,
                     pow2s=(False, True)) -> dict:
    """Compiled quantizers vs ``fmtkit.quantize`` (XLA on the same device), bit for bit."""
    import jax.numpy as jnp
    import numpy as np

    from fmtkit.scaling import BlockScaling, quantize
    from pallas_kernels import quantize_1x128, quantize_128x128

    out: dict[str, Any] = {}
    ok_all = True
    for dtype in dtypes or (jnp.float32, jnp.bfloat16):
        x = _hard_input(*shape, dtype, seed=0)
        for pow2 in pow2s:
            for name, fn, block in (("1x128", quantize_1x128, (1, 128)),
                                    ("128x128", quantize_128x128, (128, 128))):
                v, s = fn(x, power_of_two=pow2, impl=impl)
                sa = quantize(x, "e4m3", BlockScaling(block, power_of_two=pow2))
                nan = np.isnan(np.asarray(sa.values, np.float32))
                same_nan = bool(np.array_equal(np.isnan(np.asarray(v, np.float32)), nan))
                ok_v, bad_v = _bits_equal(np.asarray(v)[~nan], np.asarray(sa.values)[~nan])
                ok_s, bad_s = _bits_equal(s, sa.scale)
                ok = ok_v and ok_s and same_nan
                ok_all = ok_all and ok
                out[f"{name}-{np.dtype(dtype).name}-pow2={pow2}"] = {
                    "ok": ok, "value_mismatches": bad_v, "scale_mismatches": bad_s,
                    "nan_mask_equal": same_nan}
    out["ok"] = ok_all
    return out


def check_matmul(m: int, n: int, k: int, *, impl: str = "kernel", config=None,
                 f32: bool = True, bf16: bool = False, b_rows: bool = False) -> dict:
    """``blockwise_fp8_matmul`` at one shape against its reference (f32 output if ``f32``,
    bf16 output if ``bf16``) and against the f32 product of the unquantized inputs."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels import blockwise_fp8_matmul, blockwise_fp8_matmul_reference
    from pallas_kernels.bench import make_operands
    from pallas_kernels.quantize import quantize_1x128_reference

    ops = make_operands(m, n, k, seed=1)
    wq, ws = (quantize_1x128_reference(ops["w"]) if b_rows else (ops["wq"], ops["ws"]))
    args = (ops["xq"], ops["xs"], wq, ws)
    row: dict[str, Any] = {"shape": [m, n, k], "b_rows": b_rows,
                           "config": None if config is None else str(config)}
    ref = blockwise_fp8_matmul_reference(*args, out_dtype=jnp.float32)
    exact = jax.jit(lambda x, w: jnp.dot(x, w.T, precision=jax.lax.Precision.HIGHEST))(
        ops["x"], ops["w"])
    row["reference_deepgemm_diff_vs_exact"] = _deepgemm_diff(ref, exact)
    ok = True
    if f32:
        got = blockwise_fp8_matmul(*args, out_dtype=jnp.float32, impl=impl, config=config)
        row["rel_fro_f32_vs_reference"] = _rel_fro(got, ref)
        row["deepgemm_diff_vs_exact"] = _deepgemm_diff(got, exact)
        ok = (row["rel_fro_f32_vs_reference"] < F32_RTOL_GPU
              and row["deepgemm_diff_vs_exact"] < DEEPGEMM_DIFF)
    if bf16:
        got16 = blockwise_fp8_matmul(*args, out_dtype=jnp.bfloat16, impl=impl, config=config)
        row["rel_fro_bf16_vs_reference"] = _rel_fro(got16, ref)
        row["bf16_deepgemm_diff_vs_exact"] = _deepgemm_diff(got16, exact)
        ok = (ok and row["rel_fro_bf16_vs_reference"] < BF16_RTOL
              and row["bf16_deepgemm_diff_vs_exact"] < DEEPGEMM_DIFF)
    row["ok"] = bool(ok)
    return row


def check_gradients(m: int, n: int, k: int, *, impl: str = "kernel") -> dict:
    """``blockwise_fp8_dgrad`` / ``blockwise_fp8_wgrad`` vs their reference paths and the
    exact f32 weight gradient."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels import blockwise_fp8_dgrad, blockwise_fp8_wgrad
    from pallas_kernels.bench import make_operands

    ops = make_operands(m, n, k, seed=2)
    dy = jax.random.normal(jax.random.key(3), (m, n), jnp.float32)
    dx = blockwise_fp8_dgrad(dy, ops["wq"], ops["ws"], out_dtype=jnp.float32, impl=impl)
    dx_ref = blockwise_fp8_dgrad(dy, ops["wq"], ops["ws"], out_dtype=jnp.float32,
                                 impl="reference")
    dw = blockwise_fp8_wgrad(dy, ops["x"], impl=impl)
    dw_ref = blockwise_fp8_wgrad(dy, ops["x"], impl="reference")
    dw_exact = jax.jit(lambda g, x: jnp.dot(g.T, x, precision=jax.lax.Precision.HIGHEST))(
        dy, ops["x"])
    row = {"shape": [m, n, k], "dgrad_rel_fro_vs_reference": _rel_fro(dx, dx_ref),
           "wgrad_rel_fro_vs_reference": _rel_fro(dw, dw_ref),
           "wgrad_deepgemm_diff_vs_exact": _deepgemm_diff(dw, dw_exact)}
    row["ok"] = bool(row["dgrad_rel_fro_vs_reference"] < F32_RTOL_GPU
                     and row["wgrad_rel_fro_vs_reference"] < F32_RTOL_GPU
                     and row["wgrad_deepgemm_diff_vs_exact"] < DEEPGEMM_DIFF)
    return row


def environment() -> dict:
    import jax

    from pallas_kernels import _backend

    dev = jax.devices()[0]
    return {"ok": True, "jax": jax.__version__, "backend": jax.default_backend(),
            "device": getattr(dev, "device_kind", str(dev)),
            "compute_capability": str(getattr(dev, "compute_capability", "")),
            "num_sms": _backend.num_sms("kernel"), "hopper": _backend.is_hopper(),
            "python": sys.version.split()[0], "date": time.strftime("%Y-%m-%d")}


# --------------------------------------------------------------------------------------
# The items of each phase.


def _config_key(config) -> str:
    return str(config)


def _items(phase: str, *, rehearsal: bool, repeats: int, excluded: set[str]
           ) -> list[tuple[str, Callable[[], dict]]]:
    """(name, thunk) pairs of a phase, in the order they run."""
    import jax.numpy as jnp

    from pallas_kernels import _backend
    from pallas_kernels.bench import DEFAULT_SHAPES, bench_shape
    from pallas_kernels.config import (
        BLOCK_K,
        SHIPPED_CONFIGS,
        choose_config,
        pipeline_stages,
        smem_bytes,
    )

    impl = "interpret" if rehearsal else "kernel"

    def chosen(m, n, k, dt=jnp.bfloat16, b_rows=False):
        """choose_config, or the first shipped config that passed the smoke phase if the
        chosen one failed there."""
        cfg = choose_config(m, n, k, dt, _backend.num_sms("kernel"), b_rows=b_rows)
        if _config_key(cfg) not in excluded:
            return cfg
        for c in SHIPPED_CONFIGS.values():
            if _config_key(c) not in excluded:
                return c
        return cfg

    items: list[tuple[str, Callable[[], dict]]] = []
    if phase == "smoke":
        m, n, k = (256, 256, 512) if rehearsal else SMOKE_SHAPE
        items.append(("env", environment))
        for cfg in SHIPPED_CONFIGS.values():
            def run(cfg=cfg):
                print(f"=== gpu_check smoke: config {cfg} ===", flush=True)
                # bf16 out (the training path's): one compile per config here.
                r = check_matmul(m, n, k, impl=impl, config=cfg, f32=False, bf16=True)
                stages, persistent = pipeline_stages(cfg, k // BLOCK_K)
                r.update(stages=stages, persistent=persistent,
                         smem_bytes_model={dt: smem_bytes(cfg, dt, stages)
                                           for dt in ("bfloat16", "float32")})
                return r
            items.append((f"matmul-{cfg}-{m}x{n}x{k}", run))
        cfg = chosen(m, n, k, jnp.float32, b_rows=True)  # the weight-gradient form
        items.append((f"matmul-b-rows-{cfg}-{m}x{n}x{k}",
                      lambda: check_matmul(m, n, k, impl=impl, config=cfg, b_rows=True)))
        g = (128, 256, 128) if rehearsal else (1024, 1024, 1024)
        items.append((f"gradients-{'x'.join(map(str, g))}",
                      lambda: check_gradients(*g, impl=impl)))
        q = (256, 384) if rehearsal else (2048, 1024)
        items.append((f"quantizers-{q[0]}x{q[1]}", lambda: check_quantizers(
            impl, shape=q, dtypes=(jnp.float32,), pow2s=(False,))))
    elif phase == "correctness":
        shapes = ((256, 256, 384), (128, 320, 256)) if rehearsal else CHECK_SHAPES
        bf16_shapes = ((128, 320, 256),) if rehearsal else BF16_SHAPES
        for m, n, k in shapes:
            cfg = chosen(m, n, k, jnp.float32)
            items.append((f"matmul-{m}x{n}x{k}", lambda m=m, n=n, k=k, cfg=cfg: check_matmul(
                m, n, k, impl=impl, config=cfg, bf16=(m, n, k) in bf16_shapes)))
        g = (128, 256, 128) if rehearsal else (4096, 7168, 2048)
        items.append((f"gradients-{'x'.join(map(str, g))}",
                      lambda: check_gradients(*g, impl=impl)))
        q = (256, 384) if rehearsal else (4096, 7168)
        items.append((f"quantizers-{q[0]}x{q[1]}", lambda: check_quantizers(impl, shape=q)))
    elif phase == "bench":
        shapes = ((256, 256, 256),) if rehearsal else DEFAULT_SHAPES
        for m, n, k in shapes:
            cfg = chosen(m, n, k)
            items.append((f"{m}x{n}x{k}", lambda m=m, n=n, k=k, cfg=cfg: {
                "ok": True, **bench_shape(m, n, k, repeats=repeats, with_kernel=True,
                                          with_reference=False, config=cfg, impl=impl)}))
    elif phase == "tune":
        shapes = ((256, 256, 256),) if rehearsal else TUNE_SHAPES
        for m, n, k in shapes:
            for cfg in SHIPPED_CONFIGS.values():
                if _config_key(cfg) in excluded:
                    continue
                items.append((f"{m}x{n}x{k}-{cfg}", lambda m=m, n=n, k=k, cfg=cfg: {
                    "ok": True, **bench_shape(m, n, k, repeats=repeats, with_kernel=True,
                                              with_reference=False, with_bf16=False,
                                              config=cfg, impl=impl)}))
    else:
        raise ValueError(f"phase must be one of {PHASES[:-1]}, got {phase!r}.")
    return items


# --------------------------------------------------------------------------------------
# Files.


def _write_json(path: Path, data: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str))
    os.replace(tmp, path)


def _read_json(path: Path, default: Any = None) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return default


def _record(results_file: Path, name: str, result: dict) -> None:
    data = _read_json(results_file, {"items": {}})
    data["items"][name] = result
    _write_json(results_file, data)


# --------------------------------------------------------------------------------------
# Worker: runs the items of one phase, writing progress and results as it goes.


def _worker(phase: str, out_dir: Path, deadline_at: float, skip: set[str], rehearsal: bool,
            repeats: int, excluded: set[str]) -> int:
    import jax

    if rehearsal:
        jax.config.update("jax_platforms", "cpu")
    results_file = out_dir / f"{phase}.json"
    progress_file = out_dir / f"{phase}.progress.json"
    items = _items(phase, rehearsal=rehearsal, repeats=repeats, excluded=excluded)
    for name, thunk in items:
        if name in skip:
            continue
        if time.time() > deadline_at:
            _record(results_file, name, {"skipped": "the phase's time ran out"})
            continue
        _write_json(progress_file, {"item": name, "started": time.time(), "pid": os.getpid()})
        print(f"[{phase}] {name} ...", flush=True)
        t0 = time.perf_counter()
        try:
            result = thunk()
        except Exception:  # record and go on: the next items may still tell us something
            result = {"ok": False, "error": traceback.format_exc()[-4000:]}
        result = {"item_seconds": round(time.perf_counter() - t0, 3), **result}
        _record(results_file, name, result)
        print(f"[{phase}] {name}: {'ok' if result.get('ok') else 'FAILED'} "
              f"({result['item_seconds']:.1f} s)", flush=True)
        if name == "env" and not result.get("hopper") and not rehearsal:
            break  # nothing to compile here; the watcher reports it
    _write_json(progress_file, {"item": None, "done": True})
    return 0


# --------------------------------------------------------------------------------------
# Watcher: starts workers, kills them on a per-item timeout or the global deadline.


def supervise(cmd: list[str], progress_file: Path, *, item_timeout: float,
              deadline_at: float, log_file: Path, env: dict | None = None,
              startup_timeout: float = STARTUP_TIMEOUT_S) -> dict:
    """Runs ``cmd`` in a new process group; kills the group (SIGKILL) when the item named in
    ``progress_file`` has run longer than ``item_timeout``, when no item has started within
    ``startup_timeout``, or at ``deadline_at`` (epoch seconds).

    Returns ``{"returncode", "killed": None or the reason, "item": the item in progress
    when it ended (None if it finished them all), "seconds"}``.
    """
    progress_file.unlink(missing_ok=True)
    t0 = time.time()
    with open(log_file, "a") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        killed = None
        while proc.poll() is None:
            time.sleep(_POLL_S)
            now = time.time()
            progress = _read_json(progress_file, {})
            item, started = progress.get("item"), progress.get("started")
            if now > deadline_at:
                killed = "deadline"
            elif not progress and now - t0 > startup_timeout:
                killed = f"no item started within {startup_timeout:.0f} s"
            elif item is not None and started is not None and now - started > item_timeout:
                killed = f"item ran past its {item_timeout:.0f} s timeout"
            if killed:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()
                break
    progress = _read_json(progress_file, {})
    return {"returncode": proc.returncode, "killed": killed, "item": progress.get("item"),
            "seconds": round(time.time() - t0, 1)}


def _run_phase(phase: str, out_dir: Path, deadline_at: float, *, rehearsal: bool,
               repeats: int, excluded: set[str], env: dict) -> dict:
    results_file = out_dir / f"{phase}.json"
    _write_json(results_file, {"items": {}})
    (out_dir / f"{phase}.log").unlink(missing_ok=True)  # parsed later: this run's only
    skip: list[str] = []
    runs = []
    timeout = ITEM_TIMEOUT_S[phase] * (3 if rehearsal else 1)  # CPU interpret mode is slow
    for _ in range(MAX_RESTARTS + 1):
        if deadline_at - time.time() < MIN_PHASE_S:
            runs.append({"not_started": "too little time left in the phase's budget"})
            break
        cmd = [sys.executable, "-m", "pallas_kernels.gpu_check", "--worker", phase,
               "--out-dir", str(out_dir), "--deadline-at", repr(deadline_at),
               "--repeats", str(repeats), "--skip", ",".join(skip),
               "--exclude-configs", ",".join(sorted(excluded))]
        if rehearsal:
            cmd.append("--cpu-rehearsal")
        outcome = supervise(cmd, out_dir / f"{phase}.progress.json", item_timeout=timeout,
                            deadline_at=deadline_at, log_file=out_dir / f"{phase}.log",
                            env=env)
        runs.append(outcome)
        item = outcome["item"]
        if outcome["returncode"] == 0 and item is None:
            break
        if item is None:  # died before or between items: nothing to skip, do not loop
            break
        if outcome["killed"] == "deadline":  # out of time, not a verdict on the kernel
            _record(results_file, item, {"skipped": "the phase's time ran out while it ran",
                                         "worker_seconds": outcome["seconds"]})
            break
        why = outcome["killed"] or f"worker died (exit status {outcome['returncode']})"
        _record(results_file, item, {"ok": False, "error": f"hung or crashed: {why}",
                                     "worker_seconds": outcome["seconds"]})
        print(f"[{phase}] {item}: FAILED ({why}); restarting on the remaining items",
              flush=True)
        skip.append(item)
    data = _read_json(results_file, {"items": {}})
    data["workers"] = runs
    _write_json(results_file, data)
    return data


_SMOKE_CONFIG = re.compile(r"^matmul-(bm\d+_bn\d+_split[mn]_s\d+)-\d+x")
_PTXAS_LINE = re.compile(r"ptxas|registers|spill|smem|Used \d+", re.IGNORECASE)


def parse_ptxas(log_text: str) -> list[dict]:
    """ptxas's resource lines from a worker log, grouped under the smoke config markers.

    ``MOSAIC_GPU_DUMP_PTXAS=1`` makes Mosaic GPU print ptxas's verbose output (``ptxas
    info: Used N registers, ... bytes spill stores ...``) to stdout when it compiles a
    kernel (the dump options read from the environment by jaxlib 0.11.2's
    ``get_or_set_dump_options``; without ``MOSAIC_GPU_DUMP_TO`` it goes to stdout).
    """
    groups: list[dict] = [{"config": None, "lines": []}]
    for line in log_text.splitlines():
        if line.startswith("=== gpu_check smoke: config "):
            groups.append({"config": line.removeprefix("=== gpu_check smoke: config ")
                           .removesuffix(" ===").strip(), "lines": []})
        elif _PTXAS_LINE.search(line) and not line.startswith("[smoke]"):
            groups[-1]["lines"].append(line.strip()[:300])
    for g in groups:
        regs = [int(r) for line in g["lines"] for r in re.findall(r"Used (\d+) registers", line)]
        spills = [int(s) for line in g["lines"]
                  for s in re.findall(r"(\d+) bytes spill stores", line)]
        g["max_registers"] = max(regs) if regs else None
        g["max_spill_store_bytes"] = max(spills) if spills else None
        g["lines"] = g["lines"][:40]
    return [g for g in groups if g["lines"]]


def run_pytest(timeout_s: float, log_file: Path) -> dict:
    """``pytest -m gpu tests/pallas_kernels`` (verbose, so each verdict is in the log as it
    happens); killed at ``timeout_s``: then the failures seen so far decide, and the rest
    counts as skipped."""
    cmd = [sys.executable, "-m", "pytest", "tests/pallas_kernels", "-m", "gpu", "-v",
           "-p", "no:cacheprovider"]
    with open(log_file, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=_REPO,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = None
    text = log_file.read_text()
    tail = text[-3000:]
    verdicts = re.findall(r"^(tests/\S+) (PASSED|FAILED|ERROR|SKIPPED)", text, re.MULTILINE)
    failures = [t for t, v in verdicts if v in ("FAILED", "ERROR")]
    counts = {v: sum(1 for _, x in verdicts if x == v) for v in ("PASSED", "FAILED",
                                                                 "ERROR", "SKIPPED")}
    if rc is None:
        out = {"skipped": f"killed after {timeout_s:.0f} s (out of time)", "counts": counts,
               "failures": failures, "tail": tail}
        if failures:
            out["ok"] = False
        return out
    return {"ok": rc == 0, "returncode": rc, "counts": counts, "failures": failures,
            "tail": tail}


def _summary_lines(report: dict) -> list[str]:
    lines = []
    bench = report["phases"].get("bench", {}).get("items", {})
    for name, r in bench.items():
        tf = r.get("tflops")
        if tf:
            lines.append(f"{name}: pallas_fp8 {tf.get('pallas_fp8', 0):7.1f} TFLOP/s  "
                         f"xla_bf16 {tf.get('xla_bf16', 0):7.1f}  ratio "
                         f"{r.get('ratio_kernel_over_bf16', float('nan')):.2f}x  "
                         f"[{r.get('config')}, {r['timing']['pallas_fp8']['method']}]")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pallas_kernels.gpu_check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", default="runs/gpu-check")
    p.add_argument("--repeats", type=int, default=20, help="timed calls per measurement")
    p.add_argument("--deadline", type=float, default=480.0,
                   help="seconds after which every worker is killed and the run ends "
                        "(default 480: fits a 10-minute device call with room to spare)")
    p.add_argument("--phases", default=",".join(PHASES),
                   help=f"comma-separated subset of {','.join(PHASES)}")
    p.add_argument("--cpu-rehearsal", action="store_true",
                   help="run every phase on CPU in GPU-interpret mode at small shapes "
                        "(no pytest): catches script errors before GPU time")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--deadline-at", type=float, default=None, help=argparse.SUPPRESS)
    p.add_argument("--skip", default="", help=argparse.SUPPRESS)
    p.add_argument("--exclude-configs", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.repeats <= 0:
        p.error(f"--repeats must be positive, got {args.repeats}")
    if args.worker:
        return _worker(args.worker, out_dir, args.deadline_at or time.time() + args.deadline,
                       set(filter(None, args.skip.split(","))), args.cpu_rehearsal,
                       args.repeats, set(filter(None, args.exclude_configs.split(","))))
    phases = [s.strip() for s in args.phases.split(",") if s.strip()]
    bad = [s for s in phases if s not in PHASES]
    if bad:
        p.error(f"--phases: unknown {bad}; allowed: {', '.join(PHASES)}")
    if args.cpu_rehearsal and "pytest" in phases:
        phases.remove("pytest")

    t_start = time.time()
    deadline_at = t_start + args.deadline
    report_file = out_dir / "gpu_check.json"
    report: dict = {"command": " ".join([sys.executable, "-m", "pallas_kernels.gpu_check",
                                         *(argv if argv is not None else sys.argv[1:])]),
                    "mode": "cpu-rehearsal (GPU-interpret mode, small shapes)"
                    if args.cpu_rehearsal else "gpu",
                    "deadline_s": args.deadline, "phases": {}}

    def save():
        report["elapsed_s"] = round(time.time() - t_start, 1)
        _write_json(report_file, report)

    env = dict(os.environ)  # workers import this checkout, wherever we were started from
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_REPO), env.get("PYTHONPATH")]))
    excluded: set[str] = set()
    failed = False
    for phase in phases:
        if phase == "pytest":
            left = deadline_at - time.time()
            result = (run_pytest(left - 5.0, out_dir / "pytest.log") if left > MIN_PHASE_S
                      else {"skipped": "too little time left before the global deadline"})
            report["phases"]["pytest"] = result
            failed = failed or not result.get("ok", True)
            save()
            continue
        phase_env = dict(env)
        if phase == "smoke":  # ptxas's register/spill report of every kernel compiled
            phase_env.update(MOSAIC_GPU_DUMP_PTXAS="1", MOSAIC_GPU_DUMP_RESOURCES="1")
        left = deadline_at - time.time()
        phase_deadline = time.time() + max(MIN_PHASE_S, PHASE_SHARE[phase] * left)
        data = _run_phase(phase, out_dir, min(deadline_at, phase_deadline),
                          rehearsal=args.cpu_rehearsal,
                          repeats=args.repeats, excluded=excluded, env=phase_env)
        items = data.get("items", {})
        phase_ok = all(r.get("ok", True) for r in items.values())
        report["phases"][phase] = {"ok": phase_ok, **data}
        failed = failed or not phase_ok
        print(f"[{phase}] {'ok' if phase_ok else 'FAILED'}: "
              f"{sum(bool(r.get('ok')) for r in items.values())}/{len(items)} items ok, "
              f"{sum('skipped' in r for r in items.values())} skipped", flush=True)
        if phase == "smoke":
            env_item = items.get("env", {})
            report["env"] = env_item
            log = out_dir / "smoke.log"
            report["ptxas"] = parse_ptxas(log.read_text()) if log.exists() else []
            if not env_item.get("hopper") and not args.cpu_rehearsal:
                report["status"] = ("no Hopper GPU: nothing checked" if env_item
                                    else "the smoke worker did not report the device")
                save()
                print(f"gpu_check: {report['status']} ({env_item.get('device')}).")
                return 0 if env_item else 1
            for name, r in items.items():
                cfg = _SMOKE_CONFIG.match(name)
                if cfg and r.get("ok") is False:  # failed or hung (not: never reached)
                    excluded.add(cfg.group(1))
            report["excluded_configs"] = sorted(excluded)
        save()
    skipped = any("skipped" in r for ph in report["phases"].values()
                  for r in ph.get("items", {}).values()) or any(
        "skipped" in ph for ph in report["phases"].values())
    # "incomplete": nothing failed, but the time ran out before every item ran.
    report["status"] = "failed" if failed else "incomplete" if skipped else "passed"
    save()
    for line in _summary_lines(report):
        print(line)
    print(f"gpu_check {report['status']}; wrote {report_file}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
