"""``jax.custom_vjp``: the forward rule interpreted under the policy (it also gives the
primal outputs); the user's backward rule traced on the residuals and cotangents in their
traced dtypes and interpreted under the policy too (its matmuls on the compute dtype;
``None`` gradients as JAX's zeros), its results cast to the inputs' dtypes. A rule that
cannot be traced on its own runs as written, with one warning per module.

A forward rule written as JAX's documentation writes it calls the function itself
(``f_fwd(x) = f(x), res``): inside a forward rule a ``custom_vjp`` runs its primal body (the
rule is not differentiated there), which ends the recursion.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from fmtkit._switches import SWITCHES
from fmtkit.policy._engine.binding import bind, cast, floating_dtype, is_float_value
from fmtkit.policy._engine.caches import holds_matmul
from fmtkit.policy._engine.handlers.custom_jvp import warn_untraced
from fmtkit.policy._engine.jaxprs import open_jaxpr
from fmtkit.policy._engine.walkers import Analyzer, Handler, Walker


def facts(analysis: Analyzer, eqn, args, chain, idp, dims):
    if analysis.fwd_rule:  # inside a forward rule: its primal (see ``interpret``)
        body, _ = open_jaxpr(eqn.params["call_jaxpr"])
        return analysis.walk(body, args, chain, idp, dims)
    parts = analysis.vjp_parts(eqn)
    if parts is None:
        return None
    analysis.fwd_rule += 1
    try:
        outs = analysis.walk(parts.fwd, args[parts.num_consts:], chain, idp, dims)
    finally:
        analysis.fwd_rule -= 1
    return outs[parts.num_res:]


def interpret(walker: Walker, eqn, invals, chain, idp, fp8_local):
    if walker.fwd_rule:
        body, consts = open_jaxpr(eqn.params["call_jaxpr"])
        return walker.walk(body, consts, list(invals), [chain] * len(invals), chain, idp,
                           fp8_local)
    traced_in = [v.aval.dtype for v in eqn.invars]
    if (all(not is_float_value(x) or x.dtype == d for x, d in zip(invals, traced_in))
            and not holds_matmul(open_jaxpr(eqn.params["call_jaxpr"])[0])):
        return bind(eqn, invals)  # nothing to change: JAX's own primal and rules
    parts = walker.vjp_parts(eqn)
    if parts is None:
        return None
    traced_out = [v.aval.dtype for v in eqn.outvars]
    res_avals = [v.aval for v in parts.fwd.outvars[:parts.num_res]]
    res_dtypes = [a.dtype for a in res_avals]
    consts = invals[:parts.num_consts]
    n = len(invals) - parts.num_consts

    def forward(xs):
        walker.fwd_rule += 1
        try:
            outs = walker.walk(parts.fwd, parts.fwd_consts, list(xs), [chain] * n, chain,
                               idp, fp8_local)
        finally:
            walker.fwd_rule -= 1
        computed = iter(cast(r, d) for r, d in zip(outs[:parts.num_res], res_dtypes))
        full = [*consts, *xs]
        res = [next(computed) if f is None else cast(full[f], traced_in[f])
               for f in parts.forwarded]
        return outs[parts.num_res:], res

    @jax.custom_vjp
    def policied(*xs):
        return forward(xs)[0]

    in_dtypes = [getattr(x, "dtype", None) for x in invals[parts.num_consts:]]

    def fwd(*xs):
        outs, res = forward(xs)
        return outs, res

    def bwd(res, cts):
        cts = [cast(g, d) for g, d in zip(cts, traced_out)]
        grads = _backward(walker, eqn, parts, res, cts, chain, idp, fp8_local)
        out = []
        for g, d in zip(grads, in_dtypes):
            if d is None or not floating_dtype(d):
                out.append(None)
            elif not hasattr(g, "dtype"):  # JAX's symbolic zero
                out.append(jnp.zeros(g.aval.shape, d))
            else:
                out.append(cast(g, d))
        return tuple(out)

    policied.defvjp(fwd, bwd)
    return list(policied(*invals[parts.num_consts:]))


def _backward(walker: Walker, eqn, parts, res, cts, chain, idp, fp8_local) -> list[Any]:
    """The user's backward rule on (residuals, cotangents), interpreted: traced once on
    their traced types, its matmuls then on the compute dtype. A rule that cannot be
    traced on its own runs as written, with a warning."""
    if not SWITCHES.interpret_vjp_backward:
        return list(parts.bwd.call_wrapped(*res, *cts)[0])

    def trace():
        zeros: dict[int, Any] = {}  # gradient index -> JAX's symbolic zero (or None)

        def flat(*a):
            grads, _logs = parts.bwd.call_wrapped(*a)
            zeros.update((j, g) for j, g in enumerate(grads) if not hasattr(g, "dtype"))
            return [g for g in grads if hasattr(g, "dtype")]

        avals = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (*res, *cts)]
        try:
            closed = jax.make_jaxpr(flat)(*avals)
        except Exception:  # a rule that only runs on concrete values, or JAX's internals
            return None
        return closed, zeros, len(zeros) + len(closed.jaxpr.outvars)

    traced = walker.per_call.get("bwd", eqn, trace)
    if traced is None:
        warn_untraced(walker, "vjp", chain, "The backward rule of a jax.custom_vjp")
        return list(parts.bwd.call_wrapped(*res, *cts)[0])
    closed, zeros, n_grads = traced
    args = [*res, *cts]
    computed = iter(walker.walk(closed.jaxpr, closed.consts, args, [chain] * len(args),
                                chain, (*idp, "bwd"), fp8_local))
    return [zeros[j] if j in zeros else next(computed) for j in range(n_grads)]


CUSTOM_VJP = Handler(facts=facts, interpret=interpret)
