"""The operation classes of an autocast-style policy, keyed by JAX primitive name.

A policy decides per *operation*, wherever a model writes it (inside Flax layers, in a
hand-written ``__call__``, in a plain function). The classes follow PyTorch's autocast op
reference (``torch.amp``, "CUDA Ops that can autocast to float16 / to float32"), mapped to the
primitives JAX models lower to (``jnp.einsum``, ``@``, ``Dense``, ``Einsum``, ``Embed.attend``
all become ``dot_general``; ``jax.nn.softmax`` is inlined as reduce_max / sub / exp /
reduce_sum / div; a hand-written RMSNorm is mean / rsqrt / mul):

=============  ====================================================  ==========================
class          primitives                                            what the policy does
=============  ====================================================  ==========================
matmul         dot_general, conv_general_dilated, ragged_dot_general operands in the module's
                                                                     compute dtype, or its FP8
                                                                     recipe (projections only)
f32            exp, exp2, log, log1p, expm1, rsqrt, pow, tan, sinh,  floating inputs below f32
               cosh, asin, acos, erf_inv, lgamma, digamma;           are upcast; the result
               reduce_sum, reduce_prod, reduce_max, reduce_min,      stays f32 and the next
               cumsum, cumprod, cumlogsumexp, cummax, cummin          matmul casts its own input
follow         everything else (add, mul, div, tanh, select_n,       inputs of one dtype in
               concatenate, reshape, gather, ...)                    the trace are brought to
                                                                     the widest of their current
                                                                     dtypes (autocast's
                                                                     "promote" class); a
                                                                     weakly typed constant takes
                                                                     its partner's dtype
wide           fft, eigh, svd, qr, lu, cholesky, triangular_solve,   inputs in their traced
               custom_linear_solve, callbacks (``WIDE_OPS``)         dtypes (f32), outputs too
=============  ====================================================  ==========================

Why these: autocast's float32 list holds the ops whose error grows with the input's
rounding (exp/log amplify relative error; pow; rsqrt of a small variance) and every sum
(softmax denominators, norm statistics, losses: bf16's 8 mantissa bits lose the low bits of a
long sum). ``reduce_max``/``reduce_min`` are exact in any dtype; they are in the f32 class so
the whole max-subtract / exp / sum chain of a softmax stays in one dtype. Squares
(``integer_pow``, ``square``) follow their inputs: autocast leaves ``x * x`` alone too, and the
f32 sum that follows holds the statistic's precision. ``logistic`` (sigmoid) and ``tanh``
follow their inputs (bounded outputs; autocast lists neither).

An author's own casts are kept: a ``convert_element_type`` that changes the dtype in the trace
is applied as written, and a matmul operand the author upcast to f32 is not cast down.
"""

from __future__ import annotations

from fmtkit._switches import SWITCHES

MATMUL = frozenset({"dot_general", "conv_general_dilated", "ragged_dot_general"})
# Every primitive with matmul FLOPs, which ``inspect_policy`` counts: the policy's matmuls and
# ``scaled_dot`` (a block-scaled GEMM on operands the author already quantized; it runs as
# written, its operands' formats being the author's choice).
MATMUL_LIKE = MATMUL | frozenset({"scaled_dot"})

F32_ELEMENTWISE = frozenset({
    "exp", "exp2", "log", "log1p", "expm1", "rsqrt", "pow", "tan", "sinh", "cosh", "asin",
    "acos", "erf_inv", "lgamma", "digamma",
})
F32_REDUCTIONS = frozenset({
    "reduce_sum", "reduce_prod", "reduce_max", "reduce_min", "cumsum", "cumprod",
    "cumlogsumexp", "cummax", "cummin",
})
F32_OPS = F32_ELEMENTWISE | F32_REDUCTIONS

# Ops through which a parameter stays "a parameter" (a view of the stored tensor): a matmul
# with such an operand is a projection (the FP8 presets' target).
VIEW_OPS = frozenset({
    "convert_element_type", "reshape", "transpose", "broadcast_in_dim", "squeeze",
    "expand_dims", "slice", "dynamic_slice", "copy", "copy_p", "reduce_precision",
    # inside shard_map: a replicated weight marked device-varying, an FSDP shard gathered
    "pvary", "all_gather",
    # sharding in types: a weight resharded (JAX's LLM examples reshard expert and router
    # weights before use), or moved into an auto_axes region
    "reshard", "mesh_cast",
})

# Primitives whose result depends on their operand's exact dtype, not only its value: a bit
# pattern (``bitcast_convert_type``, which fmtkit.cast's stochastic rounding and bf16 bit
# tricks use) or the next representable number (``nextafter``). They run on their inputs in
# the dtypes they were traced with.
DTYPE_EXACT = frozenset({"bitcast_convert_type", "nextafter", "scaled_dot"})

# Operations with no low-precision kernel (XLA's FFT and LAPACK-style factorizations and solves
# take f32/f64 and complex only) and host callbacks (whose Python code checks the dtypes it was
# traced with): they run on their inputs in their traced dtypes, so their outputs have the
# traced dtypes too. ``custom_linear_solve`` (``jnp.linalg.solve``, ``inv``) is a solve: its
# body runs as traced, without a warning.
WIDE_OPS = frozenset({
    "fft", "eigh", "eig", "svd", "qr", "geqrf", "geqp3", "householder_product", "lu",
    "lu_pivots_to_permutation", "cholesky", "triangular_solve", "schur", "hessenberg",
    "tridiagonal", "tridiagonal_solve", "custom_linear_solve", "pure_callback", "io_callback",
})

# Scatters and generic reductions: their body is the scalar combiner JAX builds for the
# operand dtype (``jnp.bincount``, ``x.at[i].add``, ``segment_sum``, ``lax.reduce``), never
# a matmul. They run on their inputs in their traced dtypes (the combiner is typed by them),
# as the sums they mostly are would in f32, without the warning of an unknown body.
COMBINER_OPS = frozenset({
    "scatter", "scatter-add", "scatter-sub", "scatter-mul", "scatter-min", "scatter-max",
    "reduce", "reduce_window", "select_and_scatter",
})

# Call primitives whose bodies the policy enters (``_engine.handlers`` has one handler per
# primitive with a body: these, remat, scan, cond, while, shard_map, custom_jvp/vjp; any
# other primitive with a body runs as written, inputs cast back, with a warning).
INLINE_CALLS = frozenset({"pjit", "jit", "closed_call", "core_call"})
# jax.checkpoint / nn.remat / nnx.remat (the primitive is "remat2" in jax 0.11).
REMAT = frozenset({"checkpoint", "remat2", "remat"})


def is_matmul(name: str) -> bool:
    """Whether the primitive ``name`` is a matmul of the policy (``MATMUL``)."""
    return name in MATMUL and (SWITCHES.ragged_dot_matmul or name != "ragged_dot_general")


def op_class(name: str) -> str:
    """``"matmul"``, ``"f32"``, ``"wide"`` or ``"follow"`` for a primitive name."""
    if is_matmul(name):
        return "matmul"
    if name in WIDE_OPS:
        return "wide"
    if name in F32_OPS:
        return "f32"
    return "follow"
