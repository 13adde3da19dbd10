"""The low-precision GEMMs behind the two public faces ``fmtkit.fp8`` and ``fmtkit.fp4``.

One concept per module (the public names are the faces'):

    recipes      Fp8Recipe, Fp4Recipe, the named recipes, get_recipe, and the tilings the
                 recipes own (Tile, tile_of, scaling_of)
    state        the delayed-scaling state: init_state, update_state, combine_observations
    backends     the GEMM backend registry (register_gemm_backend, entry points)
    operands     quantized [free, contraction] operands, padding, transposes
    accumulator  limited_precision_matmul (an emulated narrow accumulator)
    gemm         scaled_matmul: per-block dots, widening off GPUs, kernel dispatch
    core         the core protocol: the record (forward, backward, operands) every core gives
    autodiff     forward- and reverse-mode AD of every core, through that record
    fp8_core     the FP8 core (forward, dgrad, wgrad)
    fp4_quant    NVFP4 / MXFP4 quantization (Fp4Array)
    hadamard     the random Hadamard transform
    fp4_core     the FP4 core, and the FP4 quantization statistics
    dot          dot_general_fn and dot_general (lax.dot_general's signature) over both cores
    grouped      ragged_dot: the grouped GEMM (lax.ragged_dot, MoE experts), with its core

Imports flow from the core (formats, casting, scaling, stats, the private switches) into this
package and out through the faces; nothing here imports a face, the policy or a kernel
package (kernels register through ``backends``).
"""
