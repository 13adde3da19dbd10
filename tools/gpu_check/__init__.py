"""The one prepared GPU check: the first command to run on a GPU machine, and all it needs.

    python3 -m tools.gpu_check OUTDIR                   # <= 8 min on one H200
    python3 -m tools.gpu_check --cpu-rehearsal OUTDIR   # the same code on CPU
    make gpu-check                                      # OUTDIR runs/gpu-check

It leaves in OUTDIR ``gpu_check.json`` (the summary, rewritten as every item finishes),
``gpu_check_logs.tar.gz`` (every worker's log, the per-phase results, ptxas's output and
the telemetry samples; rebuilt after every phase) and the profile phase's traces. Phases,
in order:

1. ``compile``: the device, driver and versions; then every shipped config in the
   forward form (bf16 out) and the weight-gradient form (B scaled per row, f32 out), each
   under its own kernel name, with lowering, XLA compile (Mosaic GPU's PTX and ptxas) and
   first-run times taken separately, and ptxas's registers, spill bytes and any wgmma
   serialization warning attributed to the kernel by name (``MOSAIC_GPU_DUMP_PTXAS=1``), and
   its SASS instruction counts (``MOSAIC_GPU_DUMP_SASS=1``: global loads, HGMMA, TMA...).
   Configs that fail here are left out of the later phases.
2. ``correctness``: block-magnitude data (per-block magnitudes spread over 2^-6..2^6, so
   every scale differs and a misapplied one shows) at the production shapes, bf16 and f32
   output, against float64 on a sample of rows and columns (128 of each, spread evenly
   over the 128-blocks):
   relative Frobenius error, max error, the worst blocks; the gradient GEMMs; the
   quantizers bit for bit against ``fmtkit.quantize``.
3. ``bench``: per production shape, interleaved rounds (>= 30) of the kernel with bf16
   and with f32 output, XLA's bf16 dot, XLA's per-tensor FP8 dot (whether XLA made it a
   cuBLASLt FP8 GEMM is read from the compiled HLO) and ``torch._scaled_mm`` with
   blockwise scales when torch is importable; min / median / max and TFLOP/s. Then
   ``fp8-per-tensor``: fmtkit's per-tensor FP8 GEMM and the three GEMMs of its ``current``
   recipe against XLA bf16, with the GEMM custom calls they compiled to and XLA's GEMM
   rewriter's FP8 log lines (``TF_CPP_VMODULE=gemm_rewriter=1``).
4. ``train``: the policied training steps of a Llama-style stack at d_model 4096 (SwiGLU
   11008, 4 blocks, 8192 tokens) and of a d_model-1024 transformer LM under f32 (the Llama
   stack only), bf16-mixed, fp8-current, fp8-delayed and fp8-blockwise (steps/s), through
   the ``fmtkit bench fp8-step`` CLI (run as a command: the tool imports no study, only
   ``studies.lib``); and the optimizer step of the studies' optax chain (``fmtkit.optim``
   master weights and dynamic loss scaling around adamw) beside plain ``optax.adamw``,
   interleaved, with their ratio.
5. ``tune``: every shipped config at 8192^3 and 4096x7168x2048 (data for ``choose_config``).
6. ``profile`` (at most 30 s): the blockwise kernel once at 4096x7168x16384 (bf16 out) and
   in the weight-gradient form at 7168x2112x4096 (f32 out) under Mosaic GPU's intra-kernel
   profiler, reduced to per-warpgroup region times (``profile``); the raw traces are
   written beside the summary (``gpu_check_profile_*.json``).
7. ``pytest``: the compiled-mode kernel tests and the per-tensor cuBLASLt test, in the time
   left.

Nothing can hang the window: every item runs in a worker subprocess (its own process
group) that the watcher kills when the item overruns its timeout, when the phase's share
of the time left (``PHASE_SHARE``) or the global ``--deadline`` runs out (checked every
0.5 s); the worker is restarted on the remaining items. The watcher itself never
initializes a JAX backend (it would take the GPU's memory from the workers); it samples
``nvidia-smi`` (clocks, power, temperature, throttle reasons) before, during and after.
With ``--cpu-rehearsal`` every phase runs the same functions on CPU at tiny shapes in
GPU-interpret mode; values only a GPU can give are null. Exit status 1 if a check failed
or hung, 0 otherwise (also without a Hopper GPU, after saying so).

One module per part: ``cli`` (the command line and the run over the phases), ``watcher``
(worker processes, their watchdog and restarts), ``worker`` (a worker: the items of a
phase, run in order), ``smi`` (the nvidia-smi sampler), ``compilation`` (compile items and
ptxas's report), ``correctness``, ``bench`` (and its interleaved timing), ``train`` (the
training step, as a command), ``optimizer`` (the optax chain against plain adamw),
``tune``, ``profile`` (the intra-kernel profile), ``kernel_tests`` (the pytest phase),
``report`` (the summary and its files).
"""
