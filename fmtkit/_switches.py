"""The private switches of fmtkit's implementation, in one place that the code reads.

Each switch selects between the form fmtkit ships (the default) and a plainer form it replaces.
Tests flip one to show that a check notices the difference (a negative control), through
``flipped``, instead of patching a module's attribute: the private layout of the modules is then
free to change without breaking the suite. The code reads a switch while it traces, so JAX's
caches of traced functions are cleared whenever one changes. Never part of the public API.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import jax


@dataclasses.dataclass
class Switches:
    """The switches, each on (the shipped form) unless a test flips it."""

    # Policy engine.
    trace_cache: bool = True
    """Reuse a traced jaxpr for equal arguments (a policied call is traced once per shape)."""
    jit_primitives: bool = True
    """Bind re-emitted primitives and casts through small jits (one trace each, not one per
    equation), inlined as they are traced (``jit_inline``)."""
    jit_inline: jax.Inline = jax.Inline.JAX_EARLY
    """How those jits are inlined: into the enclosing jaxpr as it is traced."""
    dedup_cotangent: bool = True
    """Round a cotangent once when several uses of a value would each round it."""
    nested_policies: bool = True
    """A policied call inside another policied model's trace keeps its own policy (off: the
    outer policy decides its ops)."""
    note_nested_calls: bool = True
    """A trace notes the policied calls made inside it, so that a recording
    (``inspect_policy``) does not reuse it."""
    trace_jvp_rules: bool = True
    """Trace a ``custom_jvp``'s rule around a matmul to interpret it (off: taken as one that
    cannot be traced: it runs as written, with a warning)."""
    interpret_vjp_backward: bool = True
    """Interpret a ``custom_vjp``'s backward rule under the policy (off: it runs as written)."""
    stop_gradient_ends_head: bool = True
    """A value through ``stop_gradient`` derives from no output head (a frozen teacher's
    logits)."""
    onehot_lookups: bool = True
    """A matmul with a one-hot operand is an embedding lookup, not a projection (never FP8)."""
    honour_asked_precision: bool = True
    """A matmul whose author asked for its precision runs on its traced dtypes, with a warning."""
    keep_asked_wide_output: bool = True
    """A matmul result wider than its operands that the author asked for is kept."""
    dpa_f32_logits: bool = True
    """``jax.nn.dot_product_attention``'s logits keep JAX's f32 results for narrow inputs."""
    complex_as_traced: bool = True
    """A complex matmul runs in its traced dtype (no complex bf16 or FP8)."""
    fp32_identity: bool = True
    """Rules that change nothing (``"fp32"``) bind every op as traced, without exit casts."""
    rebind_traced_mesh: bool = True
    """An equation traced under another abstract mesh (``auto_axes``) is bound under it."""
    ragged_dot_form: bool = True
    """``lax.ragged_dot``'s grouped GEMM is recognized (the FP8 recipes' grouped GEMM)."""
    narrow_mixed_backward: bool = True
    """A matmul with a wider result than its operands (the head's f32 logits) runs its
    backward GEMMs on the operands' dtype (off: a plain dot, JAX's own transpose)."""
    fp8_conv_warning: str = "once"
    """Convolutions an FP8 recipe covers (they run on the compute dtype) are warned about once
    per interpreted call, naming every module (the other forms: "never", "per_conv")."""
    weight_on_either_side: bool = True
    """A parameter on a matmul's left (``weight @ x``) takes the FP8 recipe's weight slot."""
    wide_ops_as_traced: bool = True
    """FFT, linear algebra and host callbacks (``_ops.WIDE_OPS``) run on their traced dtypes
    (off: they follow their inputs, as any op does)."""
    ragged_dot_matmul: bool = True
    """``lax.ragged_dot`` is a matmul of the policy: on the compute dtype, counted (off: it
    follows its inputs, as an op the policy does not know as a matmul)."""
    mixed_matmul_jvp: bool = True
    """The head's mixed matmul (narrow operands, wider result) is a ``custom_jvp``, so
    forward-mode AD goes through it (off: a ``custom_vjp``, its former form)."""
    remat_forward_kind: bool = True
    """``inspect_policy`` labels a forward matmul that ``jax.checkpoint`` recomputes on the
    backward pass "forward" (off: by its place on the backward pass, dgrad or wgrad)."""

    # FP8 GEMM.
    reuse_quantized_operands: bool = True
    """An operand whose tile is the same along both axes (per tensor, square blocks) is saved
    quantized by the forward GEMM and transposed for the backward GEMMs, and a per-tensor
    gradient quantized for dgrad is transposed for wgrad (off: each backward GEMM quantizes
    it again from the saved input: the same values and scales, one more pass each)."""
    scan_block_dots: bool = True
    """Off GPUs, per-block partials of 128-wide (or wider) blocks are one 2-D dot per block in a
    ``lax.scan`` (bounded memory) rather than one batched dot."""
    fold_pow2_scales: bool = True
    """Off GPUs, power-of-two scales are folded into the operands (exact) and one dot sums."""
    widen_off_gpu: bool = True
    """Off GPUs, FP8 dot operands are widened exactly to bf16 (XLA:CPU would run an f32 GEMM)."""
    cublaslt_form: bool = True
    """On GPUs, a GEMM of two per-tensor operands takes the form XLA rewrites into cuBLASLt's
    FP8 GEMM."""
    partials_budget_bytes: int = 32 * 2**20
    """Largest ``[C/g, F1, F2]`` f32 partials computed as one batched dot (32 MiB: well inside
    any accelerator's memory, small enough for a CPU test)."""

    # Debug tools.
    debug_loop_slots: bool = True
    """In a loop body, a GEMM's statistics fill the current iteration's slot (off: slot 0)."""
    debug_weight_as_read: bool = True
    """Quantization statistics replay the weight as its GEMM reads it, ``[N, K]`` (off: stored)."""

    # Optimizers.
    fused_finite_fallback: bool = True
    """``all_finite``'s exact test sums ``x - x``, fused (off: ``all(isfinite(x))`` per leaf)."""


SWITCHES = Switches()
"""The switches the code reads."""


@contextlib.contextmanager
def flipped(**changes) -> Iterator[Switches]:
    """Sets switches for the body of a ``with`` and restores them after, clearing JAX's caches
    of traced functions on both sides (a trace made under one setting must not be reused under
    the other). Unknown names are refused."""
    known = {f.name for f in dataclasses.fields(Switches)}
    unknown = sorted(set(changes) - known)
    if unknown:
        raise ValueError(f"flipped: unknown switches {unknown}; known: {sorted(known)}")
    saved = {name: getattr(SWITCHES, name) for name in changes}
    for name, value in changes.items():
        setattr(SWITCHES, name, value)
    jax.clear_caches()
    try:
        yield SWITCHES
    finally:
        for name, value in saved.items():
            setattr(SWITCHES, name, value)
        jax.clear_caches()
