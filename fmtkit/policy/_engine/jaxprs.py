"""Jaxpr and dtype helpers of the engine: a leaf (it imports no other module of the engine).

``open_jaxpr`` (a body parameter as open jaxpr and consts), ``has_body``, ``scan_counts``
(a ``scan``'s operand groups), ``vjp_parts`` (a ``custom_vjp_call`` taken apart) and
``floating_dtype``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np

F32 = np.dtype(np.float32)


@functools.lru_cache(maxsize=256)
def floating_dtype(dtype) -> bool:
    """Whether ``dtype`` is a floating dtype (cached: a few dtypes, asked per operand)."""
    return jnp.issubdtype(dtype, jnp.floating)


def open_jaxpr(jaxpr) -> tuple[Any, Sequence[Any]]:
    """(open jaxpr, consts) of a Jaxpr or ClosedJaxpr parameter."""
    if isinstance(jaxpr, jex.ClosedJaxpr):
        return jaxpr.jaxpr, jaxpr.consts
    return jaxpr, ()


def has_body(eqn) -> bool:
    """Whether an equation's parameters hold a jaxpr (a body or a rule)."""
    return bool(list(jex.jaxprs_in_params(eqn.params)))


@dataclasses.dataclass(frozen=True)
class VjpParts:
    """A ``custom_vjp_call`` taken apart: the user's forward rule as a jaxpr (inputs: the
    primal inputs after ``num_consts`` consts; outputs: ``num_res`` residuals, then the
    primal outputs), which residuals are forwarded inputs, and the user's backward rule."""

    fwd: Any
    fwd_consts: Sequence[Any]
    num_consts: int
    num_res: int
    forwarded: tuple[int | None, ...]  # per residual: the input it is, or None (computed)
    bwd: Any


def vjp_parts(eqn) -> VjpParts | None:
    """JAX keeps a custom VJP's forward rule as a thunk that traces it (``fwd_jaxpr_thunk``,
    called as JAX's own ``lift_fwd`` does) and the backward as a flat function of (residuals,
    cotangents) -> (input cotangents, logs): private structure, so None (the primitive then
    runs as traced, with a warning) if it is not what jax 0.11 has."""
    try:
        p = eqn.params
        nc = int(p["num_consts"])
        nonzero = [floating_dtype(v.aval.dtype) for v in eqn.invars[nc:]]
        fwd, consts = p["fwd_jaxpr_thunk"].call_wrapped(*nonzero)
        _, res_tree, forwarded = p["out_trees"]()
        num_res = res_tree.num_leaves - sum(f is not None for f in forwarded)
        if len(fwd.outvars) != num_res + len(eqn.outvars) or len(fwd.invars) != len(nonzero):
            return None
        return VjpParts(fwd, tuple(consts), nc, num_res, tuple(forwarded), p["bwd"])
    except Exception:  # any change of JAX's internals: run as traced (and warn)
        return None


def scan_counts(eqn) -> tuple[int, int, int] | None:
    """(consts, carry, xs) operand counts of a ``scan`` equation, or None if unknown."""
    try:
        n0, n1, n2 = (len(group) for group in eqn.params["ft_in"].elts)
    except (KeyError, AttributeError, TypeError, ValueError):
        return None
    if n0 + n1 + n2 != len(eqn.invars):
        return None
    if len(eqn.params["jaxpr"].jaxpr.outvars) != len(eqn.outvars):
        return None
    return n0, n1, n2
