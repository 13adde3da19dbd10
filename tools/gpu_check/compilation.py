"""The ``compile`` phase: every shipped kernel variant compiled and run once, and ptxas's
report of each (registers, spills, wgmma serialization), attributed by kernel name.

Each compile item prints ``KERNEL_MARK`` with its kernel's name before it compiles and an
end marker after, so that ptxas's lines in the worker's log (``MOSAIC_GPU_DUMP_PTXAS=1``)
can be attributed even where ptxas does not name the kernel.
"""

from __future__ import annotations

import importlib.metadata
import re
import time

from studies.lib.common import environment as studies_environment
from tools.gpu_check.correctness import (
    BF16_RTOL,
    block_magnitude_operands,
    f32_rtol,
    float64_errors,
)

__all__ = ["COMPILE_SHAPE", "KERNEL_MARK", "SASS_OPCODES", "compile_kernel", "environment",
           "parse_ptxas", "parse_sass"]

# Several tiles per CTA for every config on 132 SMs and 8 K blocks (every ring wraps).
COMPILE_SHAPE = (4096, 2048, 1024)
KERNEL_MARK = "=== gpu_check kernel: "


def compile_kernel(m: int, n: int, k: int, *, impl: str, config, out_dtype: str,
                   b_rows: bool) -> dict:
    """One kernel variant: lowering, compile and first-run times taken separately, a
    second run, and its output against float64 on a sample. Prints a marker with the
    kernel's name first, so that ptxas's report in the log can be attributed."""
    import functools

    import jax

    from pallas_kernels import blockwise_fp8_matmul
    from pallas_kernels.blockwise_fp8_matmul import kernel_name

    name = kernel_name(config, out_dtype, b_rows)
    print(f"{KERNEL_MARK}{name} ===", flush=True)
    ops = block_magnitude_operands(m, n, k, b_rows=b_rows, seed=5)
    args = (ops["xq"], ops["xs"], ops["wq"], ops["ws"])
    jax.block_until_ready(args)
    fn = jax.jit(functools.partial(blockwise_fp8_matmul, out_dtype=out_dtype, impl=impl,
                                   config=config))
    t0 = time.perf_counter()
    lowered = fn.trace(*args).lower()
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    out = jax.block_until_ready(compiled(*args))
    t3 = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    t4 = time.perf_counter()
    print(f"{KERNEL_MARK}end ===", flush=True)
    e = float64_errors(out, ops)
    bound = BF16_RTOL if out_dtype == "bfloat16" else f32_rtol(impl)
    return {"kernel": name, "config": str(config), "out_dtype": out_dtype,
            "form": "wgrad (B scaled per row)" if b_rows else "forward (B per 128x128)",
            "shape": [m, n, k], "lower_s": t1 - t0, "compile_s": t2 - t1,
            "first_run_s": t3 - t2, "second_run_s": t4 - t3,
            "rel_fro_vs_float64": e["rel_fro_vs_float64"],
            "ok": bool(e["rel_fro_vs_float64"] < bound)}


def environment() -> dict:
    """What every results file records (``studies.lib.common.environment``: versions,
    device, machine, commit, date), jax's and jaxlib's versions at the top, and the GPU's:
    the backend, device kind, compute capability, SM count, whether it is a Hopper GPU,
    torch's version."""
    import jax

    import pallas_kernels

    dev = jax.devices()[0]
    try:
        torch_version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        torch_version = None
    env = studies_environment()
    return {"ok": True, **env, "jax": env["versions"]["jax"],
            "jaxlib": env["versions"]["jaxlib"], "backend": jax.default_backend(),
            "device_kind": getattr(dev, "device_kind", str(dev)),
            "compute_capability": getattr(dev, "compute_capability", None),
            "num_sms": pallas_kernels.num_sms("kernel"), "hopper": pallas_kernels.is_hopper(),
            "torch": torch_version}


# ptxas's report.

_ENTRY = re.compile(r"Compiling entry function '([^']+)'")
_FUNC_PROPS = re.compile(r"Function properties for (\S+)")


def parse_ptxas(log_text: str, kernels: list[str]) -> dict[str, dict]:
    """ptxas's verbose report (``MOSAIC_GPU_DUMP_PTXAS=1``: Mosaic GPU prints it to stdout
    as it compiles, per jaxlib 0.11.2's dump options) per kernel, from a worker log.

    A line belongs to the kernel named by the last ``Compiling entry function 'F'`` or
    ``Function properties for F`` line if one of ``kernels`` is a part of F (Mosaic GPU
    may decorate the name), else to the kernel whose ``KERNEL_MARK`` marker was printed
    last (each compile item prints one before it compiles). All of a kernel's lines are
    kept. Returns, per kernel: registers, spill store / load bytes, stack frame bytes (the
    largest reported), wgmma-serialization warnings, the lines.
    """
    by_kernel: dict[str, list[str]] = {}
    marked = entry = None
    for line in log_text.splitlines():
        if line.startswith(KERNEL_MARK):
            name = line.removeprefix(KERNEL_MARK).removesuffix(" ===").strip()
            marked, entry = (None if name == "end" else name), None
            continue
        found = _ENTRY.search(line) or _FUNC_PROPS.search(line)
        if found:
            fn = found.group(1)
            entry = next((k for k in sorted(kernels, key=len, reverse=True) if k in fn),
                         None)
        owner = entry or marked
        if owner is None or not re.search(r"ptxas|registers|spill|stack frame|wgmma|"
                                          r"cmem|smem", line, re.IGNORECASE):
            continue
        by_kernel.setdefault(owner, []).append(line.strip())
    out = {}
    for name, lines in by_kernel.items():
        def biggest(pattern, lines=lines):
            vals = [int(v) for line in lines for v in re.findall(pattern, line)]
            return max(vals) if vals else None

        out[name] = {
            "registers": biggest(r"Used (\d+) registers"),
            "spill_store_bytes": biggest(r"(\d+) bytes spill stores"),
            "spill_load_bytes": biggest(r"(\d+) bytes spill loads"),
            "stack_frame_bytes": biggest(r"(\d+) bytes stack frame"),
            "wgmma_serialization_warnings": [
                line for line in lines if "wgmma" in line.lower() and "serializ" in line.lower()],
            "lines": lines}
    return out


# The SASS (``MOSAIC_GPU_DUMP_SASS=1``: Mosaic GPU prints each kernel's SASS to stdout as it
# compiles, between the item's markers).

SASS_OPCODES = ("LDG", "STG", "LDS", "STS", "LDSM", "HGMMA", "UTMALDG", "UTMASTG", "SYNCS",
                "BAR", "WARPGROUP", "FFMA", "FMUL", "BRA")
"""The instructions counted per kernel: global loads and stores (a scale read from global
memory in the K loop shows as LDG), shared memory, wgmma (HGMMA), TMA copies (UTMALDG /
UTMASTG), barriers (SYNCS: mbarriers), the promotion's f32 multiply-adds and branches."""
_SASS_LINE = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T\d]+\s+)?([A-Z][A-Z0-9]*)[.\s]")


def parse_sass(log_text: str) -> dict[str, dict]:
    """Per kernel (by the ``KERNEL_MARK`` marker printed before its compile), the count of
    each of ``SASS_OPCODES`` and of all SASS instructions in the log's dump."""
    counts: dict[str, dict[str, int]] = {}
    marked = None
    for line in log_text.splitlines():
        if line.startswith(KERNEL_MARK):
            name = line.removeprefix(KERNEL_MARK).removesuffix(" ===").strip()
            marked = None if name == "end" else name
            continue
        m = _SASS_LINE.search(line) if marked else None
        if m:
            c = counts.setdefault(marked, {"instructions": 0})
            c["instructions"] += 1
            if m.group(1) in SASS_OPCODES:
                c[m.group(1)] = c.get(m.group(1), 0) + 1
    return counts
