"""The emulated FP8 GEMM: ``scaled_matmul``, its per-block dots, the widening of FP8 dot
operands off GPUs, and the dispatch to a registered kernel.

A GEMM of quantized ``a [F1, C]`` and ``b [F2, C]`` (both contraction-minor, DeepSeek's
K-major layout) with scales per tile is computed with the scales applied per block of the
contraction (DeepSeek-V3's promotion into f32):

    g = the smaller contraction tile of a and b
    out[i, j] = sum_kb  sa[i, kb] * sb[j, kb] * (a_q[i, kb*g:(kb+1)*g] · b_q[j, kb*g:(kb+1)*g])

with each partial product an FP8 dot accumulated in f32. When both scales are constant along
the contraction (per-tensor, per-row) this is one FP8 dot followed by the outer product of
the scales. When both are powers of two (MX, ``power_of_two``) and the GEMM runs off a GPU,
the scales are folded into the operands (exact) and one dot sums the same products
(``_folds_scales``). Off GPUs every dot reads its FP8 operands widened exactly to bf16
(XLA:CPU would convert them to f32 and run its slower f32 GEMM: ``_emulated_dot``), and
per-block partials of 128-wide (or wider) blocks are one 2-D dot per block in a ``lax.scan``
(``_block_dots``); on a GPU the operands always enter the dot as FP8, and a GEMM of two
per-tensor operands takes the form XLA rewrites into cuBLASLt's FP8 GEMM
(``_per_tensor_dot``).

The forms this module ships are private switches (``fmtkit._switches``: ``scan_block_dots``,
``fold_pow2_scales``, ``widen_off_gpu``, ``cublaslt_form``, and ``partials_budget_bytes``,
whose default is ``PARTIALS_BUDGET_BYTES``), read here while tracing; tests flip them with
``fmtkit._switches.flipped``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from fmtkit._lowp.accumulator import limited_precision_matmul
from fmtkit._lowp.backends import kernel_backend, on_gpu
from fmtkit._lowp.operands import Operand
from fmtkit._lowp.recipes import Fp8Recipe
from fmtkit._switches import SWITCHES, Switches
from fmtkit.scaling import ScaledArray, dequantize


def _expand_scale(sa: ScaledArray, g: int) -> jax.Array:
    """Scale as f32 [F, C / g]: repeated along the free dim and over g-blocks of C."""
    s = sa.scale.astype(jnp.float32)
    f, c = sa.values.shape
    bf, bc = sa.block
    if bf > 1:
        s = jnp.repeat(s, bf, axis=0)
    if bc > g:
        s = jnp.repeat(s, bc // g, axis=1)
    return jnp.broadcast_to(s, (f, c // g))


def scaled_matmul(a: ScaledArray, b: ScaledArray, recipe: Fp8Recipe | None = None
                  ) -> jax.Array:
    """f32 ``a [F1, C] · b [F2, C]ᵀ`` of two quantized operands, scales applied per C-block.

    With ``g`` the smaller contraction block of the two, each of the ``C / g`` partial
    products is an FP8 dot with f32 output, scaled by its blocks' scales and added into one
    f32 accumulator, blocks in order. Off GPUs, with blocks of 128 or more, each step of a
    ``lax.scan`` over the blocks is one 2-D dot (``_block_dots``). Otherwise, only when all
    ``[C/g, F1, F2]`` partials fit in ``PARTIALS_BUDGET_BYTES`` are they one batched dot; a
    larger GEMM accumulates one block per ``lax.scan`` step, so its temporaries are the
    accumulator and one partial product.
    When both scales are constant along C (per tensor, per row) it is one FP8 dot and an
    outer product of scales. When both are powers of two (MX's E8M0, ``power_of_two``) and
    the GEMM runs off a GPU, the scales are folded into the operands and one f32 dot sums
    the same exact products (``_folds_scales``: equal up to the f32 summation order).

    Raises:
      ValueError: mismatched contraction sizes.
    """
    return _scaled_matmul(a, b, recipe, transposed=False)


def _scaled_matmul(a: ScaledArray | Operand, b: ScaledArray | Operand,
                   recipe: Fp8Recipe | None, *, transposed: bool) -> jax.Array:
    """``scaled_matmul`` of operands stored either way (``Operand``); ``transposed``: its
    transpose [F2, F1], bit for bit. Where both scales are constant along C it is computed
    in that layout (the product ``b · aᵀ`` holds the same sums, and the scales are applied in
    the same order, a's first): a weight gradient wanted as [K, N] for a [K, N] kernel is
    then written once, not transposed and copied after."""
    a, b = (t if isinstance(t, Operand) else Operand(t) for t in (a, b))
    fa, c = a.shape
    fb, cb = b.shape
    if c != cb:
        raise ValueError(f"contraction sizes differ: a has {c}, b has {cb}.")
    g = min(a.block[1], b.block[1])
    nb = c // g
    acc_bits = recipe.accum_mantissa_bits if recipe is not None else None
    if acc_bits is not None:
        la, lb = a.logical(), b.logical()
        sa, sb = _expand_scale(la, g), _expand_scale(lb, g)
        if recipe.promote_every is not None and recipe.promote_every % g and g % (
                recipe.promote_every):
            raise ValueError(f"promote_every={recipe.promote_every} must divide or be a "
                             f"multiple of the scale block {g}.")
        # Emulation: dequantize per element (exact products), accumulate in the limited
        # register; scales are folded into the operands, equivalent up to f32 round-off.
        av = la.values.astype(jnp.float32) * jnp.repeat(sa, g, axis=1)
        bv = lb.values.astype(jnp.float32) * jnp.repeat(sb, g, axis=1)
        out = limited_precision_matmul(av, bv, mantissa_bits=acc_bits,
                                       promote_every=recipe.promote_every)
        return out.T if transposed else out
    ca, cb_ = int(not a.cmajor), int(not b.cmajor)  # the stored axis each one contracts
    if nb > 1 and _folds_scales(a.sa, b.sa):
        # Power-of-two scales: dequantize (exact, in bf16) and run one dot over all of C,
        # accumulated in f32, in a named scope that tells a jaxpr reader the operands'
        # formats (WIDENED_SCOPE).
        with jax.named_scope(_scope(a, b)):
            av, bv = dequantize(a.sa, _WIDE_DTYPE), dequantize(b.sa, _WIDE_DTYPE)
            if transposed:
                return _wide_dot(bv, av, (((cb_,), (ca,)), ((), ())))
            return _wide_dot(av, bv, (((ca,), (cb_,)), ((), ())))
    if nb == 1:
        if _cublaslt_form(a, b):
            return _per_tensor_dot(a, b, (((ca,), (cb_,)), ((), ())), transposed)
        sa, sb = _row_scales(a), _row_scales(b)
        if transposed:
            out_t = _emulated_dot(b, a, b.sa.values, a.sa.values, (((cb_,), (ca,)), ((), ())))
            return out_t * sa.T * sb
        out = _emulated_dot(a, b, a.sa.values, b.sa.values, (((ca,), (cb_,)), ((), ())))
        # (out * sa) * sb, in that order: bit-identical to the earlier releases.
        return out * sa * sb.T
    # Per-block partial products (DeepSeek-V3's promotion into f32), scaled per block and
    # summed in f32. Off GPUs, blocks of at least _MIN_SCAN_BLOCK: one 2-D dot per block in a
    # lax.scan (_block_dots). Otherwise, when all partials fit in PARTIALS_BUDGET_BYTES: one
    # batched FP8 dot [nb, F1, F2] and a sum; else one block per step of a lax.scan into one
    # f32 accumulator (temporaries: the accumulator and one partial).
    sa = _rows(_block_scale(a, g), fa)  # [F1, nb]
    sb = _rows(_block_scale(b, g), fb)  # [F2, nb]
    if (SWITCHES.scan_block_dots and g >= _MIN_SCAN_BLOCK and _widens(a.sa.values)
            and _widens(b.sa.values)):
        return _block_dots(a, b, sa, sb, g, transposed)
    group = nb if 4 * nb * fa * fb <= SWITCHES.partials_budget_bytes else 1

    def split(t: Operand) -> tuple[jax.Array, int]:
        """Stored values split into [..., nb / group, group, g, ...] and the axis of
        nb / group ([F, nb/group, group, g], or [nb/group, group, g, F] if cmajor)."""
        f = t.shape[0]
        if t.cmajor:
            return t.sa.values.reshape(nb // group, group, g, f), 0
        return t.sa.values.reshape(f, nb // group, group, g), 1

    (av, ia), (bv, ib) = split(a), split(b)

    da = (1, 0) if a.cmajor else (2, 1)  # (contracting, batch) axis of a block of a
    db = (1, 0) if b.cmajor else (2, 1)

    def chunk(i):
        pa = lax.dynamic_index_in_dim(av, i, axis=ia, keepdims=False)  # [F1, group, g]
        pb = lax.dynamic_index_in_dim(bv, i, axis=ib, keepdims=False)  # (or [group, g, F])
        ca_ = lax.dynamic_slice_in_dim(sa, i * group, group, axis=1).T  # [group, F1]
        cb2 = lax.dynamic_slice_in_dim(sb, i * group, group, axis=1).T
        if transposed:  # the same products, scaled in the same order, laid out [F2, F1]
            parts = _emulated_dot(b, a, pb, pa, (((db[0],), (da[0],)), ((db[1],), (da[1],)))
                             )  # [group, F2, F1]
            return jnp.sum(parts * ca_[:, None, :] * cb2[:, :, None], axis=0)
        parts = _emulated_dot(a, b, pa, pb, (((da[0],), (db[0],)), ((da[1],), (db[1],)))
                         )  # [group, F1, F2]
        return jnp.sum(parts * ca_[:, :, None] * cb2[:, None, :], axis=0)

    if group == nb:
        return chunk(0)
    acc, _ = lax.scan(lambda acc, i: (acc + chunk(i), None),
                      jnp.zeros((fb, fa) if transposed else (fa, fb), jnp.float32),
                      jnp.arange(nb // group))
    return acc


def _block_dots(a: Operand, b: Operand, sa: jax.Array, sb: jax.Array, g: int,
                transposed: bool) -> jax.Array:
    """``_scaled_matmul``'s per-block form off GPUs: a ``lax.scan`` over the C / g blocks
    whose step is one 2-D dot of block i of both operands (stored values widened exactly to
    bf16, f32 output, in the ``WIDENED_SCOPE`` scope), scaled by the blocks' scales ``sa``
    [F1, nb] and ``sb`` [F2, nb] (a's first) and added into one f32 accumulator, blocks in
    order; ``transposed``: the same products laid out [F2, F1] (as the batched form).

    XLA:CPU converts the operands of a batched bf16 dot (the other per-block form) to f32
    and runs an f32 GEMM; a 2-D bf16 x bf16 -> f32 dot runs its faster bf16 GEMM. The loop
    (faster on XLA:CPU than the same C / g dots unrolled) keeps one dot equation per GEMM
    whatever the contraction (a jaxpr reader sees one GEMM, FLOPs times the scan length) and
    one partial product live at a time.

    Same exact products as the batched form; the f32 roundings may differ: XLA:CPU's bf16
    GEMM sums a block's 128 products in another order than its f32 GEMM (under 1% of the
    partials differ, in the last bit) and may fuse the last scale multiply and the
    accumulation into one FMA (one rounding fewer). Both stay within the f32 summation bound
    of the exact block-scaled sum, and are bit-identical wherever that sum is exact in f32.
    """
    ca, cb = int(not a.cmajor), int(not b.cmajor)  # the stored axis each one contracts
    av, bv = a.sa.values.astype(_WIDE_DTYPE), b.sa.values.astype(_WIDE_DTYPE)

    def step(acc, i):
        pa = lax.dynamic_slice_in_dim(av, i * g, g, axis=ca)
        pb = lax.dynamic_slice_in_dim(bv, i * g, g, axis=cb)
        s1 = lax.dynamic_slice_in_dim(sa, i, 1, axis=1)  # [F1, 1]
        s2 = lax.dynamic_slice_in_dim(sb, i, 1, axis=1)  # [F2, 1]
        with jax.named_scope(_scope(a, b)):
            if transposed:
                part = lax.dot_general(pb, pa, (((cb,), (ca,)), ((), ())),
                                       preferred_element_type=jnp.float32)
                return acc + part * s1.T * s2, None
            part = lax.dot_general(pa, pb, (((ca,), (cb,)), ((), ())),
                                   preferred_element_type=jnp.float32)
            return acc + part * s1 * s2.T, None

    fa, fb = a.shape[0], b.shape[0]
    acc = jnp.zeros((fb, fa) if transposed else (fa, fb), jnp.float32)
    return lax.scan(step, acc, jnp.arange(sa.shape[1]), unroll=_BLOCK_DOTS_UNROLL)[0]


_BLOCK_DOTS_UNROLL = 2
"""Blocks per loop iteration of ``_block_dots``' scan: two ran the blockwise FP8 step faster
on XLA:CPU than one, and all blocks unrolled into separate dots slower than either. (XLA
fuses the two steps' multiply-adds on its own terms, so the f32 roundings depend on it,
within the same summation bound.)"""

_MIN_SCAN_BLOCK = 128
"""Smallest contraction block ``_block_dots`` takes. A [F1, 128] x [128, F2] bf16 dot runs
XLA:CPU's bf16 GEMM well (blockwise: DeepSeek-V3's 128); NVFP4's 16-wide blocks would make 8x
as many thin dots, slower on XLA:CPU than the batched form."""

WIDENED_SCOPE = "fmtkit_fp8_widened"
"""Prefix of the named scope around an emulated FP8 GEMM's dot whose operands enter it
widened off GPUs (``_emulated_dot``; scales folded in by ``_folds_scales``, or not),
``fmtkit_fp8_widened-<lhs format>-<rhs format>`` (e.g.
``fmtkit_fp8_widened-float8_e4m3fn-float8_e4m3fn``): its dot reads bf16 operands, and a jaxpr
reader (``fmtkit.policy.inspect_policy``) reports the FP8 formats the GEMM computes in."""

_WIDE_DTYPE = jnp.bfloat16
"""The dtype FP8 dot operands enter the dot in off GPUs (and the folded operands'): bf16
holds every FP8 element exactly (E4M3 / E5M2 have at most 4 significant bits and bf16's
exponent range covers theirs; a folded element is such a value times a power of two),
and XLA:CPU runs a bf16 x bf16 -> f32 dot (f32 accumulation) several times faster than the
f32 GEMM it makes of an f32 or FP8 dot (it converts FP8 operands to f32 first)."""


def _scope(a: Operand, b: Operand) -> str:
    return f"{WIDENED_SCOPE}-{a.sa.fmt.name}-{b.sa.fmt.name}"


def _widens(values: jax.Array) -> bool:
    """Whether ``_emulated_dot`` widens these stored values: off GPUs, a format bf16 holds
    exactly (at most 8 significant bits, exponents within bf16's)."""
    fi = jnp.finfo(values.dtype)
    wide = jnp.finfo(_WIDE_DTYPE)
    return (SWITCHES.widen_off_gpu and fi.bits < 16 and fi.nmant <= wide.nmant
            and fi.maxexp <= wide.maxexp and fi.minexp >= wide.minexp and not on_gpu())


def _emulated_dot(a: Operand, b: Operand, av: jax.Array, bv: jax.Array, dims) -> jax.Array:
    """``lax.dot_general(av, bv, dims)`` with f32 accumulation of the stored FP8 values
    ``av`` (of ``a``) and ``bv`` (of ``b``). On a GPU they enter the dot as FP8 (the FP8
    GEMM contract). Off GPUs they enter it widened to bf16 (``_WIDE_DTYPE``), in the
    ``WIDENED_SCOPE`` scope that names their formats: the same values (bf16 holds every
    FP8 element), the same exact products in f32, summed in f32 (only the summation order
    may differ from the f32 GEMM XLA:CPU makes of an FP8 dot), at about 4x the speed."""
    if not (_widens(av) and _widens(bv)):
        return lax.dot_general(av, bv, dims, preferred_element_type=jnp.float32)
    with jax.named_scope(_scope(a, b)):
        return _wide_dot(av.astype(_WIDE_DTYPE), bv.astype(_WIDE_DTYPE), dims)


def widened_operands(av: jax.Array, bv: jax.Array, fmt_a: str, fmt_b: str
                     ) -> tuple[jax.Array, jax.Array, str | None]:
    """Stored FP8 values ``av`` and ``bv`` as a GEMM outside this module (the grouped GEMM,
    ``fmtkit.fp8.ragged_dot``) feeds them to its dot: off GPUs widened exactly to bf16 with
    the ``WIDENED_SCOPE`` scope name that tells a jaxpr reader their formats (``fmt_a``,
    ``fmt_b``: the formats' names), as ``_emulated_dot`` does; on a GPU (or a format bf16
    does not hold) unchanged, with no scope (None)."""
    if not (_widens(av) and _widens(bv)):
        return av, bv, None
    return (av.astype(_WIDE_DTYPE), bv.astype(_WIDE_DTYPE),
            f"{WIDENED_SCOPE}-{fmt_a}-{fmt_b}")


def _wide_dot(av: jax.Array, bv: jax.Array, dims) -> jax.Array:
    """``lax.dot_general(av, bv, dims)`` of bf16 operands into f32, in a form XLA:CPU runs.

    XLA:CPU (jax 0.11) rejects at run time some bf16 x bf16 -> f32 dots ("Unsupported
    element type for DotThunk::Execute: BF16 x BF16 = F32"): those whose operands' batch
    and contraction axes sit in different places (the per-block partials of a
    contraction-major operand with a contraction-minor one), and those into which its
    simplifier folds an operand's transpose (a data-gradient GEMM of a model batched with
    ``jax.vmap`` inside ``lax.scan``: Equinox's ``weight @ x`` in a GRU cell). So the
    operands are laid out [*batch, free, contraction] (the transpose fuses with the
    widening into one pass) behind ``lax.optimization_barrier``, which keeps XLA from
    folding the transposes back into the dot. Same output and layout [*batch, a free,
    b free] as ``lax.dot_general``."""
    (ca, cb), (ba, bb) = dims
    free_a = [d for d in range(av.ndim) if d not in (*ca, *ba)]
    free_b = [d for d in range(bv.ndim) if d not in (*cb, *bb)]
    av = jnp.transpose(av, (*ba, *free_a, *ca))
    bv = jnp.transpose(bv, (*bb, *free_b, *cb))
    # (one barrier per operand: each output is its own input, for jaxpr readers too)
    av, bv = lax.optimization_barrier(av), lax.optimization_barrier(bv)
    n = len(ba)
    dims = ((tuple(range(av.ndim - len(ca), av.ndim)),
             tuple(range(bv.ndim - len(cb), bv.ndim))),
            (tuple(range(n)), tuple(range(n))))
    return lax.dot_general(av, bv, dims, preferred_element_type=jnp.float32)


def _pow2_scales(sa: ScaledArray) -> bool:
    """Whether every scale of ``sa`` is a power of two: E8M0 (MX) or ``power_of_two``."""
    return sa.scale.dtype == jnp.float8_e8m0fnu or bool(
        getattr(sa.recipe, "power_of_two", False))


def _folds_scales(a: ScaledArray, b: ScaledArray) -> bool:
    """Whether ``scaled_matmul`` folds the per-block scales into the operands and runs one
    f32 dot over the whole contraction instead of one FP8 dot per block.

    Where both operands' scales are powers of two, ``values * scale`` is exact (a power of
    two only shifts the exponent; held in bf16, ``_WIDE_DTYPE``), and so is each product of
    two such elements in the dot's f32 accumulation (at most 4 + 4 significant bits of
    FP8 x FP8, 24 available): the one dot sums the same
    exact products as the per-block partials ``(a_q · b_q) * sa * sb``; only the order of
    the f32 summation differs (which XLA's dot does not fix either). Bounds: exact while
    the dequantized elements and their products are f32 normals (above 2^-126, the range
    an f32 matmul of the unquantized inputs itself keeps: a block's dequantized elements
    are its inputs rounded to the FP8 grid, within 2x of its amax), so the two forms can
    differ only for products below 2^-126 (XLA:CPU flushes those to zero; the per-block form
    may keep a sum of such products) or outputs beyond f32's range.

    Done only off GPUs: there every dot reads widened operands anyway (``_emulated_dot``;
    the widening and the scale fuse into one pass), and the per-block form costs C/32
    partial products of the output's size. On a GPU the FP8 operands go into the dot
    (per block), as the FP8 GEMM contract requires.
    """
    return (SWITCHES.fold_pow2_scales and _pow2_scales(a) and _pow2_scales(b) and not on_gpu())


def _cublaslt_form(a: Operand, b: Operand) -> bool:
    """Whether a GEMM of one scale per operand runs in the form XLA's GPU GEMM rewriter
    turns into cuBLASLt's FP8 GEMM (``_per_tensor_dot``): on a GPU, with FP8 stored values
    that enter the dot as they are (off GPUs they are widened: ``_emulated_dot``)."""
    return (SWITCHES.cublaslt_form and on_gpu() and a.sa.scale.size == 1 and b.sa.scale.size == 1
            and not (_widens(a.sa.values) or _widens(b.sa.values)))


def _per_tensor_dot(a: Operand, b: Operand, dims, transposed: bool) -> jax.Array:
    """``a · bᵀ`` (or, ``transposed``, ``b · aᵀ``) of two per-tensor operands on a GPU, f32:
    ``dot(a_q, b_q) * (sa * sb)``, the form of XLA's GPU GEMM rewriter
    (``xla/service/gpu/transforms/gemm_rewriter.cc``):

    - the FP8 arrays are the dot's operands, nothing between them and the dot (its
      ``MatchFp8Param`` "directly operating on an FP8 operand"; a convert, or a multiply by
      anything but a broadcast scalar, between dequantization and dot stops the match);
    - the output is f32 (cuBLASLt's FP8 GEMM writes f32, bf16, f16 or FP8);
    - the two scales are one f32 scalar, multiplied into the dot's output through a
      broadcast of a rank-0 array, the dot's only user: the rewriter's ``F8ScaleD`` folds it
      into the call's scale operand, so cuBLASLt writes the scaled output in one pass. (A
      scale kept as a [1, 1] array, or two multiplies, leaves elementwise passes over the f32
      output after the GEMM.)

    cuBLASLt has no E5M2 x E5M2 FP8 GEMM: the rewriter computes such a dot in f16 (no shipped
    recipe has one). On Hopper cuBLASLt reads both operands contraction-minor; XLA's GPU layout
    assignment and the rewriter lay out (transpose) the FP8 values where they are stored the
    other way, a pass over one byte per element instead of a second quantization.
    """
    lhs, rhs = (b, a) if transposed else (a, b)
    if transposed:
        (ca, cb), batch = dims
        dims = ((cb, ca), batch)
    out = lax.dot_general(lhs.sa.values, rhs.sa.values, dims,
                          preferred_element_type=jnp.float32)
    scale = (a.sa.scale.reshape(()).astype(jnp.float32)
             * b.sa.scale.reshape(()).astype(jnp.float32))
    return out * scale


def _row_scales(op: Operand) -> jax.Array:
    """f32 scales [F, 1] (or [1, 1]) of an operand whose scale is constant along C."""
    s = op.scale().astype(jnp.float32)
    if op.block[0] > 1 and s.shape[0] > 1:
        s = jnp.repeat(s, op.block[0], axis=0)
    return s


PARTIALS_BUDGET_BYTES: int = Switches.partials_budget_bytes
"""Most bytes of f32 per-block partial products ``scaled_matmul`` materializes at once where
they come from batched dots (on a GPU, and for blocks narrower than 128), 32 MiB: below it,
all partials come from one batched dot (a 512 x 512 output with 16 MX blocks is 16 MiB; the
loop form is several times slower on CPU at such sizes); above it (a 4096 x 7168 output is
112 MiB per partial), blocks are accumulated one at a time. The GEMM reads the private switch
of which this is the default (tests lower it to reach the loop form with small arrays)."""


def _block_scale(op: Operand, g: int) -> jax.Array:
    """f32 scale [F / bf, C / g] (repeated along C when the operand's blocks exceed g)."""
    s = op.scale().astype(jnp.float32)
    c = op.shape[1]
    if s.shape[1] != c // g:
        s = jnp.repeat(s, (c // g) // s.shape[1], axis=1)
    return s


def _rows(s: jax.Array, f: int) -> jax.Array:
    """Per-block-of-rows scales [F / bf, n] broadcast to [F, n]."""
    if s.shape[0] == f:
        return s
    n = s.shape[1]
    return jnp.broadcast_to(s[:, None, :], (s.shape[0], f // s.shape[0], n)).reshape(f, n)

def gemm(a: Operand, b: Operand, recipe: Fp8Recipe, out_dtype=jnp.float32,
         transposed: bool = False) -> jax.Array:
    """``a · bᵀ`` [F1, F2] through a registered kernel or ``scaled_matmul``; ``transposed``:
    its transpose [F2, F1] (same bits), produced in that layout where it can be."""
    found = None
    if recipe.use_kernel == "interpret" or (recipe.use_kernel == "auto" and on_gpu()):
        found = kernel_backend(recipe, a.logical(), b.logical())
    if found is not None:
        a, b = a.logical(), b.logical()
        backend, impl = found
        out = backend.fn(a.values, a.scale, b.values, b.scale, impl=impl,
                         out_dtype=out_dtype)
        return out.T if transposed else out
    return _scaled_matmul(a, b, recipe, transposed=transposed).astype(out_dtype)


def gemm_dtype(consumer_dtype) -> jnp.dtype:
    """A GEMM's output dtype: bf16 where its consumer is bf16 (one rounding of the f32
    accumulation either way), else f32."""
    return jnp.dtype(jnp.bfloat16 if consumer_dtype == jnp.bfloat16 else jnp.float32)


# Named scopes of the backward GEMMs (FP8 and FP4), so a jaxpr reader
# (``fmtkit.policy.inspect_policy``) tells the data gradient from the weight gradient without
# guessing from shapes.
DGRAD_SCOPE = "fmtkit_dgrad"
WGRAD_SCOPE = "fmtkit_wgrad"

