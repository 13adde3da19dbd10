"""``jax.custom_jvp``: the primal body interpreted. Its JVP rule: where the body holds a
matmul, the rule too (traced once by ``jax.jvp`` on the traced types, then interpreted: its
matmuls on the compute dtype; a rule that cannot be traced on its own runs as written, with
one warning per module); otherwise (``jax.nn.relu``, ``softplus``) the original rule on the
primals cast back to their traced dtypes."""

from __future__ import annotations

import jax
import numpy as np

from fmtkit._switches import SWITCHES
from fmtkit.policy._engine.binding import bind, cast, floating_dtype, is_float_value
from fmtkit.policy._engine.caches import holds_matmul
from fmtkit.policy._engine.walkers import Analyzer, Handler, Walker


def float0(x):
    """The tangent of a non-differentiable (integer, boolean) value."""
    return np.zeros(np.shape(x), jax.dtypes.float0)


def warn_untraced(walker: Walker, kind: str, chain, rule: str) -> None:
    """One warning per module: ``rule`` could not be traced on its own (it only runs on
    concrete values, or on JAX's internals), so it runs as written."""
    path = walker.path(chain[-1] if chain else None)
    walker.warn(f"{kind}:{path}", f"{rule} in module {path or '<root>'!r} could not be "
                "traced on its own: it runs as written (its matmuls in their traced "
                "dtypes).")


def facts(analysis: Analyzer, eqn, args, chain, idp, dims):
    return analysis.walk(eqn.params["call_jaxpr"].jaxpr, args, chain, idp, dims)


def interpret(walker: Walker, eqn, invals, chain, idp, fp8_local):
    traced = [v.aval.dtype for v in eqn.invars]
    with_matmul = holds_matmul(eqn.params["call_jaxpr"].jaxpr)
    if (all(not is_float_value(x) or x.dtype == d for x, d in zip(invals, traced))
            and not with_matmul):
        return bind(eqn, invals)  # dtypes as traced: the original, custom rule and all
    body = eqn.params["call_jaxpr"]
    rule = _jvp_rule(walker, eqn, chain) if with_matmul else None

    def original(*xs):
        return bind(eqn, list(xs))

    @jax.custom_jvp
    def policied(*xs):
        walker.jvp_body += 1  # (GemmSite.in_custom_rule)
        try:
            return walker.walk(body.jaxpr, body.consts, list(xs), [chain] * len(xs),
                               chain, idp, fp8_local)
        finally:
            walker.jvp_body -= 1

    @policied.defjvp
    def policied_jvp(primals, tangents):
        out = policied(*primals)
        if rule is not None:
            closed, floats = rule
            args = [*primals, *(t for t, f in zip(tangents, floats) if f)]
            t_iter = iter(walker.walk(closed.jaxpr, closed.consts, args,
                                      [chain] * len(args), chain, (*idp, "jvp"), fp8_local))
            t_out = [next(t_iter) if is_float_value(o) else float0(o) for o in out]
        else:
            p0 = [cast(p, d) for p, d in zip(primals, traced)]
            t0 = [cast(t, d) for t, d in zip(tangents, traced)]
            _, t_out = jax.jvp(original, p0, t0)
        return out, [cast(t, o.dtype) for t, o in zip(t_out, out)]

    return policied(*invals)


def _jvp_rule(walker: Walker, eqn, chain):
    """(jaxpr of (primals, floating tangents) -> floating output tangents, which inputs
    are floating) of a ``custom_jvp_call``'s own rule, or None (with a warning) where it
    cannot be traced."""
    def trace():
        if not SWITCHES.trace_jvp_rules:
            return None
        floats = [floating_dtype(v.aval.dtype) for v in eqn.invars]
        out_floats = [floating_dtype(v.aval.dtype) for v in eqn.outvars]

        def tangent(*xs):
            primals, it = xs[:len(floats)], iter(xs[len(floats):])
            tans = [next(it) if f else np.zeros(np.shape(p), jax.dtypes.float0)
                    for p, f in zip(primals, floats)]
            _, t_out = jax.jvp(lambda *a: bind(eqn, list(a)), list(primals), tans)
            return [t for t, f in zip(t_out, out_floats) if f]

        avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in eqn.invars]
        try:
            closed = jax.make_jaxpr(tangent)(*avals, *(a for a, f in zip(avals, floats) if f))
        except Exception:  # a rule that only runs on concrete values, or JAX's internals
            return None
        return closed, floats

    rule = walker.per_call.get("jvp", eqn, trace)
    if rule is None:
        warn_untraced(walker, "jvp", chain, "The JVP rule of a jax.custom_jvp around a matmul")
    return rule


CUSTOM_JVP = Handler(facts=facts, interpret=interpret)
