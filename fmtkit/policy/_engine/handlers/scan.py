"""``scan``: the body interpreted and rebuilt as a ``lax.scan`` (carry in its traced dtypes);
a delayed-FP8 slot inside gets a leading layer axis, scanned with the body.

Under ``intercept_gemms`` a GEMM in the body learns the loops around it
(``GemmSite.loop_lengths``, ``GemmSite.loop_index``): the rebuilt scan then also scans an
``arange`` of its length, each iteration's index (unused, JAX drops it from the scan).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from fmtkit.policy._engine.binding import cast
from fmtkit.policy._engine.jaxprs import scan_counts
from fmtkit.policy._engine.walkers import Analyzer, Facts, Handler, Walker
from fmtkit.policy._gemm_hook import active_hook


def facts(analysis: Analyzer, eqn, args, chain, idp, dims):
    counts = scan_counts(eqn)
    if counts is None:
        return None
    n0, n1, _ = counts
    dep = frozenset().union(*(a.dep for a in args))
    const = all(a.const for a in args)
    data = any(a.data for a in args)
    body = [a if not (n0 <= j < n0 + n1) else Facts(dep=a.dep, data=a.data)
            for j, a in enumerate(args)]
    before = set(analysis.sites.values())
    inner = analysis.walk(eqn.params["jaxpr"].jaxpr, body, chain, idp,
                          (*dims, int(eqn.params["length"])))
    analysis.scan_sites[idp] = [k for k in analysis.sites.values() if k not in before]
    dep = dep.union(*(f.dep for f in inner))
    return [Facts(dep=dep, const=const, data=data)] * len(eqn.outvars)


def interpret(walker: Walker, eqn, invals, chain, idp, fp8_local):
    counts = scan_counts(eqn)
    if counts is None:
        return None
    n0, n1, _ = counts
    body = eqn.params["jaxpr"]
    consts, init, xs = invals[:n0], invals[n0:n0 + n1], invals[n0 + n1:]
    carry_dtypes = [getattr(x, "dtype", None) for x in init]
    keys = [k for k in walker.analysis.scan_sites.get(idp, []) if k in fp8_local]
    n_in = len(invals)
    length = int(eqn.params["length"])
    # Under intercept_gemms the body also gets its iteration's index (GemmSite.loop_index)
    # as one more scanned input, so a reverse scan's index is the original position; the
    # index is not added otherwise, so the program without a hook is the same.
    index = [jnp.arange(length, dtype=jnp.int32)] if active_hook() is not None else []

    def step(carry, inp):
        x, hist, i = inp
        local = {**fp8_local, **dict(zip(keys, hist))}
        walker.loops.append((i[0] if i else None, length))
        try:
            outs = walker.walk(body.jaxpr, body.consts, [*consts, *carry, *x],
                               [chain] * n_in, chain, idp, local)
        finally:
            walker.loops.pop()
        new = [cast(o, d) if d is not None else o for o, d in zip(outs[:n1], carry_dtypes)]
        return new, outs[n1:]

    walker.loop_depth += 1
    try:
        carry, ys = lax.scan(step, list(init),
                             (list(xs), [fp8_local[k] for k in keys], index),
                             length=length,
                             reverse=eqn.params["reverse"], unroll=eqn.params["unroll"])
    finally:
        walker.loop_depth -= 1
    return [*carry, *ys]


SCAN = Handler(facts=facts, interpret=interpret)
