"""Forward- and reverse-mode AD of the FP8 / FP4 cores (the dense GEMMs and the grouped
``ragged_dot``): a ``jax.custom_jvp`` whose tangent is one primitive, ``fmtkit_fp8_tangent``,
that evaluates the forward-mode tangent and transposes to the recipe's own backward GEMMs.

JAX differentiates a ``custom_vjp`` function in reverse mode only, and reverse-differentiates
a ``custom_jvp`` function by transposing its tangent. The FP8 backward (dgrad and wgrad on
quantized cotangents, each with its own tiles) is no transpose of any linear map of the
tangents, so the tangent here is a primitive whose transpose rule *is* that backward:

* ``jax.jvp`` / ``jacfwd`` evaluate the primitive: ``ẏ = ẋ · Q(w)ᵀ + Q(x) · ẇᵀ`` (the grouped
  GEMM: ``ragged_dot(ẋ, Q(w)) + ragged_dot(Q(x), ẇ)``, its ``product``), the tangent through
  the forward GEMM's quantized operands (the quantization's derivative taken as the
  identity, as the backward GEMMs take it), in f32, rounded once to the GEMM's output dtype.
* ``jax.grad`` / ``jax.vjp`` stage the primitive in the linear part and transpose it: the
  backward function of the core's record (``Core.backward``: the recipe's dgrad and wgrad),
  on the residuals the forward pass saves, exactly as a ``custom_vjp`` with that backward
  computes.

The primitive takes the forward pass's residuals (``jax.tree`` leaves), ``x`` and ``w``
(read only by the derivative of the backward: a Hessian-vector product; unused, they are
dead code in a compiled gradient) and the tangents of ``x``, ``w`` and the amax history (the
grouped GEMM's group sizes, integers, have none).
Under ``vmap`` it is bound again with one more leading batch axis (``nbatch``), and its
evaluation and transpose map over those axes. The amax history's tangent is the one operand
that may stay unmapped (``extra_mapped``: per batch axis, whether it has it): a history
shared by a vmapped batch (``jax.vmap(policied, in_axes=(None, 0))``, the state not mapped)
receives as cotangent the max of the examples' observed amaxes over the unmapped axes, the
batch amax, as ``combine_observations`` combines micro-batches. (Broadcast like the other
operands, its cotangent would be their sum: scales up to the batch size too large.)
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from fmtkit._lowp.core import Core

TANGENT_PRIMITIVE = "fmtkit_fp8_tangent"
"""The name of the primitive that computes an FP8 / FP4 GEMM's forward-mode tangent (a jaxpr
of ``jax.jvp`` through an FP8 model shows it where the tangent GEMMs run)."""

_tangent_p = Primitive(TANGENT_PRIMITIVE)


def _mapped(fn: Callable, nbatch: int) -> Callable:
    for _ in range(nbatch):
        fn = jax.vmap(fn)
    return fn


def _full_extras(args: tuple, n: int, extra_mapped: tuple[bool, ...]) -> list:
    """``args`` with the amax history's tangent (operands from ``n + 4`` on) given every batch
    axis it lacks (``extra_mapped``: per batch axis, outermost first, whether it has it), so
    that all operands map over the same ``nbatch`` leading axes."""
    args = list(args)
    missing = tuple(i for i, m in enumerate(extra_mapped) if not m)
    if not missing:
        return args
    batch = args[n + 2].shape[:len(extra_mapped)]
    for j in range(n + 4, len(args)):
        a = jnp.expand_dims(args[j], missing)
        args[j] = jnp.broadcast_to(a, (*batch, *args[j].shape[len(extra_mapped) - len(missing):]))
    return args


def _tangent_impl(*args, tree, operands, product, bwd, nbatch, out_aval, extra_mapped):
    del bwd
    n = tree.num_leaves
    args = _full_extras(args, n, extra_mapped)

    def one(*a):
        dx, dw = a[n + 2:n + 4]
        res = jax.tree.unflatten(tree, a[:n])
        xd, wd = operands(res, dx.shape[0], dw.shape[0])
        return (product(res, dx, wd) + product(res, xd, dw)).astype(out_aval.dtype)

    return _mapped(one, nbatch)(*args)


def _tangent_abstract(*avals, tree, operands, product, bwd, nbatch, out_aval, extra_mapped):
    """y's tangent type (its sharding, and under ``shard_map`` the manual axes it varies
    over), with the batch axes of ``vmap`` in front."""
    del operands, product, bwd, extra_mapped
    if not nbatch:
        return out_aval
    batch = avals[tree.num_leaves + 2].shape[:nbatch]
    sharding = out_aval.sharding
    if sharding is not None and sharding.spec:
        sharding = sharding.update(spec=jax.sharding.PartitionSpec(
            *(None,) * nbatch, *sharding.spec))
    return out_aval.update(shape=(*batch, *out_aval.shape), sharding=sharding)


def _tangent_jvp(primals, tangents, *, tree, operands, product, bwd, nbatch, out_aval,
                 extra_mapped):
    """The tangent's own derivative (forward over forward, or reverse over forward): linear
    in ``dx``, ``dw`` (the primitive again, on their tangents) plus ``dx · ẇᵀ + ẋ · dwᵀ``
    (``product(dx, ẇ) + product(ẋ, dw)``) in f32, the quantization's derivative taken as the
    identity (the residuals' tangents are not read)."""
    params = dict(tree=tree, operands=operands, product=product, bwd=bwd, nbatch=nbatch,
                  out_aval=out_aval, extra_mapped=extra_mapped)
    n = tree.num_leaves
    out = _tangent_p.bind(*primals, **params)
    tangents = [ad.instantiate_zeros(t) for t in tangents]
    lin = _tangent_p.bind(*primals[:n + 2], *tangents[n + 2:], **params)
    dx, dw = primals[n + 2:n + 4]
    x_dot, w_dot = tangents[n:n + 2]

    def cross_one(r, a, b, c, d):
        r = jax.tree.unflatten(tree, r)
        return product(r, a, b) + product(r, c, d)

    cross = _mapped(cross_one, nbatch)(list(primals[:n]), dx, w_dot, x_dot, dw)
    return out, lin + cross.astype(out_aval.dtype)


def _tangent_transpose(ct, *args, tree, operands, product, bwd, nbatch, out_aval,
                       extra_mapped):
    del operands, product, out_aval
    n = tree.num_leaves
    res, (x, w), lin = args[:n], args[n:n + 2], args[n + 2:]
    assert not any(ad.is_undefined_primal(r) for r in (*res, x, w))  # (linear in lin only)
    if type(ct) is ad.Zero:
        return [None] * len(args)
    ct = ad.instantiate_zeros(ct)
    need = tuple(ad.is_undefined_primal(t) for t in lin)
    cts = list(_mapped(lambda r, a, b, g: bwd(need, jax.tree.unflatten(tree, r), a, b, g),
                       nbatch)(list(res), x, w, ct))
    # The observed amaxes of a history the batch shares: their max over the examples.
    missing = tuple(i for i, m in enumerate(extra_mapped) if not m)
    if missing:
        cts[2:] = [None if c is None else jnp.max(c, axis=missing) for c in cts[2:]]
    return [None] * (n + 2) + [c if ad.is_undefined_primal(t) else None
                               for c, t in zip(cts, lin)]


def _tangent_batch(args, dims, *, tree, operands, product, bwd, nbatch, out_aval,
                   extra_mapped):
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    n = tree.num_leaves
    # (the history's tangent, operands from n + 4, stays unmapped where it is: see above)
    extra = len(args) > n + 4 and dims[n + 4] is not None
    moved = [a if d is None and j >= n + 4 else jnp.broadcast_to(a, (size, *a.shape))
             if d is None else jnp.moveaxis(a, d, 0)
             for j, (a, d) in enumerate(zip(args, dims))]
    return _tangent_p.bind(*moved, tree=tree, operands=operands, product=product, bwd=bwd,
                           nbatch=nbatch + 1, out_aval=out_aval,
                           extra_mapped=(extra, *extra_mapped)), 0


_tangent_p.def_impl(_tangent_impl)
_tangent_p.def_abstract_eval(_tangent_abstract)
ad.primitive_jvps[_tangent_p] = _tangent_jvp
ad.primitive_transposes[_tangent_p] = _tangent_transpose
batching.primitive_batchers[_tangent_p] = _tangent_batch
mlir.register_lowering(_tangent_p, mlir.lower_fun(_tangent_impl, multiple_results=False))


def _zero_tangent(r: jax.Array) -> jax.Array:
    if jnp.issubdtype(r.dtype, jnp.inexact):
        return jnp.zeros_like(r)
    return np.zeros(r.shape, jax.dtypes.float0)


def differentiable(core: Core, doc: str) -> Any:
    """The core ``core(recipe, out_dtype, x, w, extra)`` of a record, differentiable both ways.

    Args:
      core: the core's functions (``fmtkit._lowp.core.Core``).
      doc: the differentiable core's docstring.

    Returns:
      The core. Its forward-mode tangent is ``ẏ = product(ẋ, Q(w)) + product(Q(x), ẇ)``
      (dense: ``ẋ · Q(w)ᵀ + Q(x) · ẇᵀ``) in f32, rounded once to y's dtype; reverse mode
      runs ``core.backward``. Differentiating the gradient forward (``jax.jvp`` of
      ``jax.grad``: Hessian-vector products) takes the tangent of the backward's ``dx``,
      ``dw`` as ``product``'s transposes through the same quantized operands, in f32: dense,
      of ``dx = g · w``, ``dw = gᵀ · x``, ``ġ · Q(w) + g · ẇ`` and ``ġᵀ · Q(x) + gᵀ · ẋ`` (the
      amax history's tangent: zero). The tangent's own derivative (``jacfwd`` of ``jacfwd``,
      ``grad`` of ``jvp``) is ``_tangent_jvp``'s.
    """
    fwd, bwd, operands, product, transposes = core

    @functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1, 2))
    def backward(recipe, out_dtype, need, res, x, w, g):
        del x, w  # (their tangents are the backward's tangent's)
        return bwd(recipe, out_dtype, res, g, need)

    @backward.defjvp
    def _backward_jvp(recipe, out_dtype, need, primals, tangents):
        res, _, _, g = primals
        _, x_dot, w_dot, g_dot = tangents
        dx, dw, dextra = bwd(recipe, out_dtype, res, g, need)
        xd, wd = operands(recipe, res, *g.shape)
        # (dense: [M, N] · [N, K] and [N, M] · [M, K], as a · bᵀ of [F, C] operands)
        ddx_q, ddw_q = transposes(res, g_dot, xd, wd)
        ddx_t, ddw_t = transposes(res, g, x_dot, w_dot)
        ddx, ddw = ddx_q + ddx_t, ddw_q + ddw_t
        return (dx, dw, dextra), (
            None if dx is None else ddx.astype(dx.dtype),
            None if dw is None else ddw.astype(dw.dtype),
            jax.tree.map(jnp.zeros_like, dextra))

    def tangent(recipe, out_dtype, y, res, primals, tangents):
        x, w, _ = primals
        leaves, tree = jax.tree.flatten(res)
        # (an integer ``extra``'s tangent, float0, is not an input: it has no gradient)
        tangents = [t for t in tangents if jax.typeof(t).dtype != jax.dtypes.float0]
        return _tangent_p.bind(
            *leaves, x, w, *tangents, tree=tree, nbatch=0, extra_mapped=(),
            operands=functools.partial(operands, recipe), product=product,
            bwd=functools.partial(backward, recipe, out_dtype),
            out_aval=jax.typeof(y).to_tangent_aval())

    # The forward pass with its residuals, for the core's JVP rule: differentiated forward
    # again (jax.jvp of jax.grad), y's tangent is the core's tangent (not the derivative of
    # the quantization's own operations), the residuals' tangents zero (the backward's
    # tangent takes x's and w's, see ``backward``).
    @functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1))
    def forward(recipe, out_dtype, x, w, hist):
        return fwd(recipe, out_dtype, x, w, hist)

    @forward.defjvp
    def _forward_jvp(recipe, out_dtype, primals, tangents):
        y, res = fwd(recipe, out_dtype, *primals)
        return (y, res), (tangent(recipe, out_dtype, y, res, primals, tangents),
                          jax.tree.map(_zero_tangent, res))

    @functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1))
    def run(recipe, out_dtype, x, w, hist):
        return fwd(recipe, out_dtype, x, w, hist)[0]

    @run.defjvp
    def _jvp(recipe, out_dtype, primals, tangents):
        y, res = forward(recipe, out_dtype, *primals)
        return y, tangent(recipe, out_dtype, y, res, primals, tangents)

    run.__doc__ = doc
    return run
