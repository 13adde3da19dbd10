"""The grouped FP8 GEMM: ``ragged_dot``, ``lax.ragged_dot`` (the GEMM of an MoE layer's experts,
megablox style) with FP8 operands and a custom VJP.

Tokens are sorted by group: rows ``[start_g, start_g + group_sizes[g])`` of ``lhs [M, K]``
meet group g's weights ``rhs[g] [K, N]``. The three GEMMs, each on FP8 operands quantized
along the axis it contracts, with the dense FP8 GEMM's quantizers (``operands``):

    forward   y  [M, N]    = x · w[g(m)]            ragged_dot, contracts K
    dgrad     dx [M, K]    = dy · w[g(m)]ᵀ          ragged_dot, contracts N
    wgrad     dw [G, K, N] = x_gᵀ · dy_g per group  ragged_dot_general, ragged contraction

The activation and the gradient get the recipe's tiles as in the dense GEMM (per tensor: one
scale for all tokens of all groups; "1x128": 128 elements of a row along the contraction).
The weight stack is quantized group by group: one scale per group for a per-tensor tile
(experts differ in range), one per 128x128 block of each group for "128x128". Scales are
applied per block of the contraction (DeepSeek-V3's promotion into f32); the wgrad's token
blocks (of the activation's and gradient's tiles along the tokens) follow the sorted token
order and may span two groups: each group's part of a block is scaled by that block's scales.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from fmtkit._lowp.autodiff import differentiable
from fmtkit._lowp.backends import kernel_backend
from fmtkit._lowp.core import Core
from fmtkit._lowp.gemm import DGRAD_SCOPE, WGRAD_SCOPE, gemm_dtype, widened_operands
from fmtkit._lowp.operands import Operand, padded_c, quantize_operand
from fmtkit._lowp.recipes import RECIPES, Fp4Recipe, Fp8Recipe, Tile, get_recipe, recipe_tiles
from fmtkit.formats import get_format
from fmtkit.scaling import ScaledArray, dequantize


def _amax(t: jax.Array, recipe: Fp8Recipe, axes=None) -> jax.Array:
    """max |t| (over ``axes``) in f32, reduced over the recipe's mesh axes."""
    amax = jnp.max(jnp.abs(t), axis=axes).astype(jnp.float32)
    for axis in recipe.amax_reduce_axes:
        amax = lax.pmax(amax, axis)
    return amax


def _given(tile: Tile, amax: jax.Array) -> jax.Array | None:
    """The amax a per-tensor tile is quantized with (None: the tiles' own)."""
    return amax if tile.kind == "tensor" else None


def _repeat_to(s: jax.Array, rows: int, cols: int) -> jax.Array:
    """A 2-D per-block scale ``[r, c]`` repeated to ``[rows, cols]`` (r | rows, c | cols)."""
    s = s.astype(jnp.float32)
    return jnp.repeat(jnp.repeat(s, rows // s.shape[0], axis=0), cols // s.shape[1], axis=1)


def _group_of_rows(group_sizes: jax.Array, m: int, g: int) -> jax.Array:
    """The group of each of ``m`` sorted rows (rows past the last group: the last group,
    whose products there are zero)."""
    ends = jnp.cumsum(group_sizes)
    gid = jnp.sum(jnp.arange(m, dtype=ends.dtype)[:, None] >= ends[None, :], axis=1)
    return jnp.minimum(gid, g - 1)


def _quantize_stack(w: jax.Array, fmt: str, tile: Tile, recipe: Fp8Recipe, c_to: int, *,
                    contract_n: bool) -> ScaledArray:
    """The weight stack ``w [G, K, N]`` quantized group by group (one scale per group for a
    per-tensor tile), stored ``[G, K', N']``: each group as the operand ``[N, K]`` stored
    contraction-major (forward: contracts K), or (``contract_n``) as ``[K, N]`` (dgrad)."""
    amax = _amax(w, recipe, axes=(1, 2))

    def one(wg, a):
        return quantize_operand(wg, fmt, tile, recipe, _given(tile, a), c_to,
                                cmajor=not contract_n).sa

    return jax.vmap(one)(w, amax)


def _ragged_dot_general(a: jax.Array, b: jax.Array, group_sizes: jax.Array,
                        dims: lax.RaggedDotDimensionNumbers, scope: str | None = None,
                        precision: lax.Precision | None = None) -> jax.Array:
    """``lax.ragged_dot_general`` to f32 (in the named ``scope``), batched under ``vmap`` as
    a loop over the mapped axis (``lax.map``, the unmapped operands shared): JAX's batching
    rule for it maps no operand whose ragged or group axis would move (``jacfwd``,
    ``jacrev`` and ``vmap`` of the grouped GEMM go through it). Not transposable: the FP8
    GEMMs run inside the core's rules, which are never differentiated themselves (the
    tangents' products are ``_f32_ragged_p``)."""
    @jax.custom_batching.custom_vmap
    def rdg(a, b, gs):
        with jax.named_scope(scope) if scope else contextlib.nullcontext():
            return lax.ragged_dot_general(a, b, gs, dims, precision=precision,
                                          preferred_element_type=jnp.float32)

    @rdg.def_vmap
    def _rule(axis_size, in_batched, a, b, gs):
        del axis_size
        args = (a, b, gs)

        def one(mapped):
            it = iter(mapped)
            return rdg(*[next(it) if bat else v for v, bat in zip(args, in_batched)])

        return lax.map(one, [v for v, bat in zip(args, in_batched) if bat]), True

    return rdg(a, b, group_sizes)


def _grouped_gemm(a: Operand, b: ScaledArray, caxis: int, group_sizes: jax.Array
                  ) -> jax.Array:
    """f32 ``out [M', F]``, row m: ``a[m] · b[g(m)]`` contracting a's C with b's axis
    ``caxis`` (1: b stored ``[G, C, F]``; 2: ``[G, F, C]``), the scales applied per block of
    the smaller contraction tile (one ragged dot per block)."""
    av, bv = a.sa.values, b.values
    mp, c = av.shape
    ng, f = bv.shape[0], bv.shape[3 - caxis]
    blk = min(c // a.sa.scale.shape[1], c // b.scale.shape[caxis])
    nb = c // blk
    sa = _repeat_to(a.sa.scale, mp, nb)  # [M', nb]
    sb = b.scale if caxis == 1 else jnp.swapaxes(b.scale, 1, 2)
    sb = jax.vmap(lambda s: _repeat_to(s, nb, f))(sb)  # [G, nb, F]
    gid = _group_of_rows(group_sizes, mp, ng)
    av, bv, scope = widened_operands(av, bv, a.sa.fmt.name, b.fmt.name)
    dims = lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(((1,), (caxis,)), ((), ())),
        lhs_ragged_dimensions=(0,), rhs_group_dimensions=(0,))

    def block(i):
        pa = lax.dynamic_slice_in_dim(av, i * blk, blk, axis=1)
        pb = lax.dynamic_slice_in_dim(bv, i * blk, blk, axis=caxis)
        part = _ragged_dot_general(pa, pb, group_sizes, dims, scope)
        s1 = lax.dynamic_slice_in_dim(sa, i, 1, axis=1)  # [M', 1]
        s2 = lax.dynamic_index_in_dim(sb, i, axis=1, keepdims=False)[gid]  # [M', F]
        return part * s1 * s2

    if nb == 1:
        return block(0)
    return lax.scan(lambda acc, i: (acc + block(i), None), jnp.zeros((mp, f), jnp.float32),
                    jnp.arange(nb))[0]


def _grouped_wgrad(a: Operand, b: Operand, group_sizes: jax.Array, ng: int) -> jax.Array:
    """f32 ``dw [G, F1, F2]``: per group, ``a_gᵀ · b_g`` over its tokens, of ``a`` and ``b``
    stored token-major (``[T', F1]``, ``[T', F2]``), the scales applied per token block (the
    smaller token tile of the two); a block's rows of each group are that group's share."""
    av, bv = a.sa.values, b.sa.values
    t, f1 = av.shape
    f2 = bv.shape[1]
    blk = min(t // a.sa.scale.shape[0], t // b.sa.scale.shape[0])
    nb = t // blk
    sa = _repeat_to(a.sa.scale, nb, f1)  # [nb, F1]
    sb = _repeat_to(b.sa.scale, nb, f2)  # [nb, F2]
    ends = jnp.cumsum(group_sizes)
    starts = ends - group_sizes
    av, bv, scope = widened_operands(av, bv, a.sa.fmt.name, b.sa.fmt.name)
    dims = lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(((0,), (0,)), ((), ())),
        lhs_ragged_dimensions=(0,), rhs_group_dimensions=())

    def block(i):
        lo = i * blk
        local = (jnp.clip(ends, lo, lo + blk) - jnp.clip(starts, lo, lo + blk)
                 ).astype(group_sizes.dtype)  # each group's rows in this block
        pa = lax.dynamic_slice_in_dim(av, lo, blk, axis=0)
        pb = lax.dynamic_slice_in_dim(bv, lo, blk, axis=0)
        part = _ragged_dot_general(pa, pb, local, dims, scope)
        s1 = lax.dynamic_index_in_dim(sa, i, axis=0, keepdims=False)
        s2 = lax.dynamic_index_in_dim(sb, i, axis=0, keepdims=False)
        return part * s1[None, :, None] * s2[None, None, :]

    if nb == 1:
        return block(0)
    return lax.scan(lambda acc, i: (acc + block(i), None),
                    jnp.zeros((ng, f1, f2), jnp.float32), jnp.arange(nb))[0]


def _forward_operands(recipe, x, w) -> tuple[Operand, ScaledArray]:
    """The forward GEMM's operands: x [M, K] and the weight stack, quantized along K."""
    tx, tw, _ = recipe_tiles(recipe)
    kp = padded_c(x.shape[1], tx, tw)
    xq = quantize_operand(x, recipe.x_format, tx, recipe, _given(tx, _amax(x, recipe)), kp)
    wq = _quantize_stack(w, recipe.w_format, tw, recipe, kp, contract_n=False)
    return xq, wq


def _probe(values_shape, scale_shape, fmt, recipe) -> ScaledArray:
    """An abstract ``[F, C]`` operand (shapes only) for a backend's ``applies``: asking
    traces no op (the operands a kernel would take are built only once one applies)."""
    return ScaledArray(jax.ShapeDtypeStruct(tuple(values_shape), fmt.dtype),
                       jax.ShapeDtypeStruct(tuple(scale_shape), jnp.float32), fmt, recipe)


def _stack_group(b: ScaledArray, caxis: int) -> ScaledArray:
    """Group 0 of a weight stack stored ``[G, C, F]`` (``caxis`` 1) or ``[G, F, C]``, as an
    abstract ``[F, C]`` operand."""
    v, sc = b.values.shape[1:], b.scale.shape[1:]
    if caxis == 1:
        v, sc = v[::-1], sc[::-1]
    return _probe(v, sc, b.fmt, b.recipe)


def _kernel_grouped_gemm(recipe, a: Operand, b: ScaledArray, caxis: int,
                         group_sizes: jax.Array, out_dtype) -> jax.Array | None:
    """``_grouped_gemm`` through a registered kernel's ``ragged`` form, or None where no
    kernel applies. The kernel reads each group ``[F, C]`` contraction-minor: a stack stored
    ``[G, C, F]`` (the forward's, from a ``[G, K, N]`` weight) is transposed first, one copy
    of the FP8 stack (a kernel-side ``[G, N, K]`` weight would avoid it)."""
    if a.cmajor:
        return None
    found = kernel_backend(recipe, _probe(a.sa.values.shape, a.sa.scale.shape, a.sa.fmt,
                                          a.sa.recipe), _stack_group(b, caxis), "ragged")
    if found is None:
        return None
    backend, impl = found
    bv, bs = b.values, b.scale
    if caxis == 1:
        bv, bs = jnp.swapaxes(bv, 1, 2), jnp.swapaxes(bs, 1, 2)
    return backend.ragged(a.sa.values, a.sa.scale, bv, bs, group_sizes, impl=impl,
                          out_dtype=gemm_dtype(out_dtype))


def _forward_gemm(recipe, x, w, group_sizes, out_dtype=jnp.float32):
    m, n = x.shape[0], w.shape[2]
    xq, wq = _forward_operands(recipe, x, w)
    out = _kernel_grouped_gemm(recipe, xq, wq, 1, group_sizes, out_dtype)
    if out is None:
        out = _grouped_gemm(xq, wq, 1, group_sizes)
    return out[:m, :n]


def expert_block_layout(group_sizes: jax.Array, m: int, block: int = 128
                        ) -> tuple[jax.Array, jax.Array, int]:
    """The padded token layout of a grouped weight gradient: ``m`` tokens sorted by group,
    moved so that every group starts on a ``block``-token block (its last block
    zero-filled), so no scale block along the tokens spans two groups (the layout of
    DeepGEMM's k-grouped weight-gradient GEMM).

    Args:
      group_sizes: int ``[G]``, the tokens of each group (sorted order, from token 0).
      m: the number of tokens.
      block: the token block (DeepSeek-V3's 128).

    Returns:
      ``dest`` int32 ``[m]``, the padded row of each token (``tp`` for tokens past
      ``sum(group_sizes)``: out of range, dropped by a scatter with ``mode="drop"``);
      ``group_blocks`` int32 ``[2, G]``, each group's first block and block count; ``tp``,
      the static padded length ``block * (cdiv(m, block) + G)``, enough for any sizes.

    Example:
      >>> dest, blocks, tp = expert_block_layout(jnp.array([3, 0, 2]), 5, block=4)
      >>> dest.tolist(), blocks.tolist(), tp
      ([0, 1, 2, 4, 5], [[0, 1, 1], [1, 0, 1]], 20)
    """
    ng = group_sizes.shape[0]
    tp = block * (-(-m // block) + ng)
    sizes = jnp.maximum(group_sizes.astype(jnp.int32), 0)
    ends = jnp.minimum(jnp.cumsum(sizes), m)
    starts = ends - jnp.minimum(sizes, ends)
    nblk = (ends - starts + block - 1) // block
    blk0 = jnp.cumsum(nblk) - nblk
    rows = jnp.arange(m, dtype=jnp.int32)
    gid = jnp.sum(rows[:, None] >= ends[None, :], axis=1)
    g = jnp.minimum(gid, ng - 1)
    dest = jnp.where(gid < ng, blk0[g] * block + rows - starts[g], tp).astype(jnp.int32)
    return dest, jnp.stack([blk0, nblk]).astype(jnp.int32), tp


def _kernel_grouped_wgrad(recipe, x, g, group_sizes, ng) -> jax.Array | None:
    """The weight gradient ``[G, K, N]`` through a registered kernel's ``ragged_wgrad``
    form, or None where no kernel applies (the recipe's x and gradient tiles must be
    ``1 x c`` along the tokens). x and the gradient are first moved to the padded token
    layout (``expert_block_layout``: a copy of both, ``block`` x G extra zero rows at
    most) and quantized there, so each scale block holds one expert's tokens; the emulated
    path's blocks follow the sorted order instead and may span two experts (the two agree
    where every group size is a multiple of the block)."""
    tx, _, tg = recipe_tiles(recipe)
    if tx.kind != "block" or tg.kind != "block" or tx.f != 1 or tg.f != 1 or tx.c != tg.c:
        return None
    m, k = x.shape
    n = g.shape[1]
    tp = tx.c * (-(-m // tx.c) + ng)  # expert_block_layout's static length
    found = kernel_backend(
        recipe, _probe((k, tp), (k, tp // tx.c), get_format(recipe.x_format), recipe),
        _probe((n, tp), (n, tp // tx.c), get_format(recipe.grad_format), recipe),
        "ragged_wgrad")
    if found is None:
        return None
    backend, impl = found
    dest, blocks, tp = expert_block_layout(group_sizes, m, tx.c)

    def padded(t, fmt, tile):
        p = jnp.zeros((tp, t.shape[1]), t.dtype).at[dest].set(t, mode="drop")
        return quantize_operand(p, fmt, tile, recipe, None, tp, cmajor=True).logical()

    xq = padded(x, recipe.x_format, tx)
    gq = padded(g, recipe.grad_format, tg)
    out = backend.ragged_wgrad(xq.values, xq.scale, gq.values, gq.scale, blocks, impl=impl,
                               out_dtype=jnp.float32)
    return out[:, :k, :n]


def _backward_gemms(recipe, x, w, group_sizes, g, need_dx: bool, need_dw: bool):
    tx, tw, tg = recipe_tiles(recipe)
    m, k = x.shape
    ng, _, n = w.shape
    amax_g = _amax(g, recipe)
    dx = dw = None
    if need_dx:  # dgrad: dx [M, K] = dy [M, N] · w[g]ᵀ, contracting N.
        np_ = padded_c(n, tg, tw)
        gq_n = quantize_operand(g, recipe.grad_format, tg, recipe, _given(tg, amax_g), np_)
        wq_n = _quantize_stack(w, recipe.w_format, tw, recipe, np_, contract_n=True)
        with jax.named_scope(DGRAD_SCOPE):
            dx = _kernel_grouped_gemm(recipe, gq_n, wq_n, 2, group_sizes, x.dtype)
            if dx is None:
                dx = _grouped_gemm(gq_n, wq_n, 2, group_sizes)
            dx = dx[:m, :k]
    if need_dw:  # wgrad: dw[g] [K, N] = x_gᵀ · dy_g, contracting each group's tokens.
        with jax.named_scope(WGRAD_SCOPE):
            dw = _kernel_grouped_wgrad(recipe, x, g, group_sizes, ng)
    if need_dw and dw is None:
        mp = padded_c(m, tg, tx)
        xq_m = quantize_operand(x, recipe.x_format, tx, recipe, _given(tx, _amax(x, recipe)),
                                mp, cmajor=True)
        gq_m = quantize_operand(g, recipe.grad_format, tg, recipe, _given(tg, amax_g), mp,
                                cmajor=True)
        with jax.named_scope(WGRAD_SCOPE):
            dw = _grouped_wgrad(xq_m, gq_m, group_sizes, ng)[:, :k, :n]
    return dx, dw


def _forward(recipe, out_dtype, x, w, group_sizes):
    return (_forward_gemm(recipe, x, w, group_sizes, out_dtype).astype(out_dtype),
            (x, w, group_sizes))


def _backward(recipe, out_dtype, res, g, need):
    # (``need``: the GEMM of an operand that needs no gradient, data or a frozen weight, is
    # not traced)
    del out_dtype
    x, w, group_sizes = res
    dx, dw = _backward_gemms(recipe, x, w, group_sizes, g.astype(jnp.float32), *need[:2])
    return (None if dx is None else dx.astype(x.dtype),
            None if dw is None else dw.astype(w.dtype), None)


def _operands(recipe, res, m, n):
    """``Q(x)`` [M, K] and ``Q(w)`` [G, K, N], the forward GEMM's operands as it multiplied
    them (dequantized, f32): the forward-mode tangent's operands (see ``fmtkit._lowp.autodiff``)."""
    del m, n
    x, w, _ = res
    (mm, k), nn = x.shape, w.shape[2]
    xq, wq = _forward_operands(recipe, x, w)
    xd = dequantize(xq.logical(), jnp.float32)[:mm, :k]
    wd = jax.vmap(lambda sa: dequantize(sa, jnp.float32))(wq)[:, :k, :nn]
    return xd, wd


# The f32 grouped products of the forward-mode tangent and of the gradient's tangent: one
# primitive whose transposes are its other forms (so reverse mode differentiates a tangent:
# ``jax.grad`` of ``jax.jvp``, ``jax.grad`` of ``jax.grad``) and whose batching is a loop over
# the mapped axis (``vmap``: ``jacfwd``, ``jax.hessian``). ``kind``:
#   "rows"   a [M, K] · b[g(m)] [K, N]           -> [M, N]     (lax.ragged_dot)
#   "rows_t" a [M, N] · b[g(m)]ᵀ, b [G, K, N]     -> [M, K]
#   "tokens" per group a_gᵀ · b_g, a [M, K], b [M, N] -> [G, K, N] (a ragged contraction)
_DIMS = {
    "rows": (((1,), (1,)), (0,), (0,)),
    "rows_t": (((1,), (2,)), (0,), (0,)),
    "tokens": (((0,), (0,)), (0,), ()),
}
_f32_ragged_p = Primitive("fmtkit_f32_ragged_dot")


def _f32_ragged(a, b, group_sizes, kind: str) -> jax.Array:
    return _f32_ragged_p.bind(a.astype(jnp.float32), b.astype(jnp.float32), group_sizes,
                              kind=kind)


def _f32_ragged_impl(a, b, gs, *, kind):
    contract, lhs_ragged, rhs_group = _DIMS[kind]
    dims = lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(contract, ((), ())),
                                         lhs_ragged_dimensions=lhs_ragged,
                                         rhs_group_dimensions=rhs_group)
    return lax.ragged_dot_general(a, b, gs, dims, precision=lax.Precision.HIGHEST,
                                  preferred_element_type=jnp.float32)


def _f32_ragged_abstract(a, b, gs, *, kind):
    if kind == "tokens":
        shape = (gs.shape[0], a.shape[1], b.shape[1])
    else:
        shape = (a.shape[0], b.shape[2 if kind == "rows" else 1])
    return jax.core.ShapedArray(shape, jnp.float32)


def _f32_ragged_jvp(primals, tangents, *, kind):
    a, b, gs = primals
    da, db, _ = (ad.instantiate_zeros(t) for t in tangents)
    return (_f32_ragged_p.bind(a, b, gs, kind=kind),
            _f32_ragged_p.bind(da, b, gs, kind=kind) + _f32_ragged_p.bind(a, db, gs, kind=kind))


# (kind, operand) -> (kind of the transpose, its operands from (ct, other operand))
_TRANSPOSES = {
    ("rows", 0): ("rows_t", lambda ct, b: (ct, b)), ("rows", 1): ("tokens", lambda ct, a: (a, ct)),
    ("rows_t", 0): ("rows", lambda ct, b: (ct, b)),
    ("rows_t", 1): ("tokens", lambda ct, a: (ct, a)),
    ("tokens", 0): ("rows_t", lambda ct, b: (b, ct)),
    ("tokens", 1): ("rows", lambda ct, a: (a, ct)),
}


def _f32_ragged_transpose(ct, a, b, gs, *, kind):
    if type(ct) is ad.Zero:
        return None, None, None
    ct = ad.instantiate_zeros(ct)
    out = [None, None, None]
    for i, (t, other) in enumerate(((a, b), (b, a))):
        if ad.is_undefined_primal(t):
            tkind, args = _TRANSPOSES[kind, i]
            out[i] = _f32_ragged_p.bind(*args(ct, other), gs, kind=tkind)
    return out


def _f32_ragged_batch(args, dims, *, kind):
    size = next(x.shape[d] for x, d in zip(args, dims) if d is not None)
    moved = [jnp.broadcast_to(x, (size, *x.shape)) if d is None else jnp.moveaxis(x, d, 0)
             for x, d in zip(args, dims)]
    return lax.map(lambda xs: _f32_ragged_p.bind(*xs, kind=kind), moved), 0


_f32_ragged_p.def_impl(_f32_ragged_impl)
_f32_ragged_p.def_abstract_eval(_f32_ragged_abstract)
ad.primitive_jvps[_f32_ragged_p] = _f32_ragged_jvp
ad.primitive_transposes[_f32_ragged_p] = _f32_ragged_transpose
batching.primitive_batchers[_f32_ragged_p] = _f32_ragged_batch
mlir.register_lowering(_f32_ragged_p, mlir.lower_fun(_f32_ragged_impl, multiple_results=False))


def _ragged_product(res, a, b):
    """``lax.ragged_dot(a [M, K], b [G, K, N], group_sizes)`` in f32 (HIGHEST)."""
    return _f32_ragged(a, b, res[2], "rows")


def _ragged_transposes(res, ct, a, b):
    """``_ragged_product``'s transposes applied to ``ct [M, N]``: ``ct · b[g(m)]ᵀ`` per row
    and, per group, ``a_gᵀ · ct_g``, in f32 (``lax.ragged_dot``'s own transposes)."""
    return _f32_ragged(ct, b, res[2], "rows_t"), _f32_ragged(a, ct, res[2], "tokens")


GROUPED_CORE = Core(forward=_forward, backward=_backward, operands=_operands,
                    product=_ragged_product, transposes=_ragged_transposes)
"""The grouped GEMM's core functions (``fmtkit._lowp.core.Core``)."""

_grouped_dot = differentiable(GROUPED_CORE, """\
``lhs [M, K]`` by the weight stack ``[G, K, N]`` in groups of rows, with the recipe's three
grouped GEMMs; ``group_sizes`` int32[G] (no gradient). Forward-mode AD: see
``fmtkit._lowp.autodiff.differentiable``.""")


def _check(lhs, rhs, group_sizes) -> None:
    for arg, t, rank in (("lhs", lhs, 2), ("rhs", rhs, 3)):
        dtype = getattr(t, "dtype", None)
        if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
            raise TypeError(f"{arg} must be a real floating array, got "
                            f"{getattr(dtype, 'name', type(t).__name__)}.")
        if t.ndim != rank:
            what = ("[M, K], tokens sorted by group" if rank == 2
                    else "[G, K, N], one [K, N] weight per group")
            raise ValueError(f"{arg} must be {rank}-D ({what}), got shape {tuple(t.shape)}.")
    gdt = getattr(group_sizes, "dtype", None)
    if gdt is None or not jnp.issubdtype(gdt, jnp.integer):
        raise TypeError("group_sizes must be an integer array (int32, as lax.ragged_dot "
                        f"takes), got {getattr(gdt, 'name', type(group_sizes).__name__)}.")
    if group_sizes.shape != (rhs.shape[0],):
        raise ValueError(f"group_sizes must have shape (G,) = ({rhs.shape[0]},), one size per "
                         f"group of rhs, got {tuple(group_sizes.shape)}.")
    if lhs.shape[1] != rhs.shape[1]:
        raise ValueError(f"lhs [M, K] and rhs [G, K, N] must share K: lhs has "
                         f"{lhs.shape[1]}, rhs has {rhs.shape[1]}.")


def ragged_dot(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array,
               recipe: str | Fp8Recipe = "blockwise", *,
               preferred_element_type: jax.typing.DTypeLike | None = None) -> jax.Array:
    """``lax.ragged_dot`` as a grouped FP8 GEMM (an MoE layer's experts), with FP8 dgrad and
    wgrad.

    ``lhs [M, K]`` holds the tokens sorted by group: rows ``[start_g, start_g +
    group_sizes[g])`` meet ``rhs[g] [K, N]`` (rows past ``sum(group_sizes)`` give zeros, as
    in ``lax.ragged_dot``; empty operands give its zeros). Each of the three GEMMs runs on
    FP8 operands quantized along the axis it contracts, with the recipe's formats and tiles,
    as in ``dot_general``:

    * forward ``y = x · w[g]`` and dgrad ``dx = dy · w[g]ᵀ``: one ``lax.ragged_dot_general``
      per block of the contraction, with the blocks' scales applied to its f32 partials;
    * wgrad ``dw[g] = x_gᵀ · dy_g`` ``[G, K, N]``: ``lax.ragged_dot_general`` with a ragged
      contraction (the tokens), per block of the token tiles.

    Scales: the activation and the gradient as in the dense GEMM (per tensor: one scale for
    all tokens of all groups; "blockwise": 1x128 tiles of a row along the contraction, and
    128 tokens x 1 column in the wgrad, blocks that follow the sorted token order across
    group boundaries). The weight stack is quantized per group: per tensor, one scale for
    each group (``amax(w[g]) / fmt.max``: experts differ in range); "128x128", the blocks of
    each group. K and N of any size: a dimension the tiles block is zero-padded inside each
    GEMM (exact) as in the dense GEMM.

    Delayed recipes run as the current recipe of the same formats, with a warning: an amax
    history per group would need a state per expert that no policy threads. FP4 recipes and
    an emulated accumulator (``accum_mantissa_bits``) are refused. A registered GEMM
    backend with ``ragged`` / ``ragged_wgrad`` forms (``use_kernel``; ``pallas_kernels``'
    grouped kernels for "blockwise" on Hopper) runs the GEMMs it applies to: the forward
    hands it the expert stack transposed to ``[G, N, K]`` (one copy of the FP8 stack), the
    wgrad moves x and dy to the padded token layout first (``expert_block_layout``; each
    expert's 1x128 token blocks then hold only its tokens, where the emulated blocks may
    span two experts). Otherwise the grouped GEMM is ``lax.ragged_dot_general`` on FP8
    operands (widened exactly to bf16 off GPUs, in the ``WIDENED_SCOPE`` scope, as the dense
    emulation). Forward-mode AD (``jax.jvp``, ``jacfwd``, Hessian-vector products) computes
    the tangent through the forward GEMM's quantized operands, ``ragged_dot(ẋ, Q(w)) +
    ragged_dot(Q(x), ẇ)`` in f32 (see ``fmtkit._lowp.autodiff``); reverse mode runs the three FP8
    GEMMs above. Under ``vmap`` (``jacfwd``, ``jacrev``) the ragged dots run as a loop over
    the mapped axis.

    Args:
      lhs: ``[M, K]`` floating, tokens sorted by group.
      rhs: ``[G, K, N]`` floating, one weight per group.
      group_sizes: int ``[G]``, the rows of each group (zero allowed), ``sum <= M``.
      recipe: a name from ``RECIPES`` or an ``Fp8Recipe``.
      preferred_element_type: the output dtype (default: the operands' promoted dtype);
        the GEMMs accumulate in f32.

    Returns:
      ``[M, N]`` of ``preferred_element_type``.

    Raises:
      TypeError: non-floating ``lhs``/``rhs``, non-integer ``group_sizes``.
      ValueError: ``lhs`` not 2-D, ``rhs`` not 3-D, ``group_sizes`` not of shape ``(G,)``,
        K differing, an FP4 recipe or ``accum_mantissa_bits`` set.

    Example:
      >>> x, w = jnp.ones((256, 128)), jnp.ones((4, 128, 64))
      >>> ragged_dot(x, w, jnp.array([100, 0, 56, 100], jnp.int32), "current").shape
      (256, 64)
    """
    _check(lhs, rhs, group_sizes)
    recipe = get_recipe(recipe)
    if isinstance(recipe, Fp4Recipe):
        raise ValueError(f"recipe={recipe.name!r}: FP4 recipes have no grouped GEMM; use an "
                         f"FP8 recipe ({', '.join(RECIPES)}).")
    if recipe.accum_mantissa_bits is not None:
        raise ValueError(f"recipe {recipe}: accum_mantissa_bits (an emulated accumulator) is "
                         "not supported by the grouped GEMM; set it to None.")
    if recipe.delayed:
        warnings.warn(
            f"fmtkit.fp8.ragged_dot: the delayed recipe {recipe} runs as current scaling "
            "(per-tensor scales from this step's amaxes; one per group for the weights): the "
            "grouped GEMM keeps no amax history.", UserWarning, stacklevel=2)
        recipe = dataclasses.replace(recipe, delayed=False)
    out_dtype = jnp.dtype(preferred_element_type if preferred_element_type is not None
                          else jnp.result_type(lhs, rhs))
    if not jnp.issubdtype(out_dtype, jnp.floating):
        raise TypeError(f"preferred_element_type must be a floating dtype, got "
                        f"{out_dtype.name}.")
    if lhs.size == 0 or rhs.size == 0:  # no products to quantize: lax.ragged_dot's zeros
        return lax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=out_dtype)
    return _grouped_dot(recipe, out_dtype, lhs, rhs, group_sizes.astype(jnp.int32))

