"""``while`` (``fori_loop`` with a traced bound, ``while_loop``): body and condition
interpreted, the carry kept in its traced dtypes (as ``scan``'s; a loop needs one carry
type)."""

from __future__ import annotations

from jax import lax

from fmtkit.policy._engine.binding import cast
from fmtkit.policy._engine.jaxprs import open_jaxpr
from fmtkit.policy._engine.walkers import Analyzer, Facts, Handler, Walker


def facts(analysis: Analyzer, eqn, args, chain, idp, dims):
    """A carry's facts hold for its initial value and every iteration's: the body is
    walked to a fixpoint (a generate loop's logits, written into a buffer the loop
    returns, make its head), its delayed-FP8 slots created by the last walk only."""
    cn, bn = eqn.params["cond_nconsts"], eqn.params["body_nconsts"]
    cj, bj = open_jaxpr(eqn.params["cond_jaxpr"])[0], open_jaxpr(eqn.params["body_jaxpr"])[0]
    carry = [Facts(const=a.const, dep=a.dep, head=a.head, data=a.data, scalar=a.scalar)
             for a in args[cn + bn:]]
    saved = dict(analysis.sites), dict(analysis.site_shapes), dict(analysis.counts)
    for _ in range(8):  # facts only grow (sets, and const turning False): few rounds
        analysis.sites, analysis.site_shapes, analysis.counts = (dict(d) for d in saved)
        outs = analysis.walk(bj, [*args[cn:cn + bn], *carry], chain, (*idp, 1), dims)
        new = [Facts(const=c.const and o.const, dep=c.dep | o.dep, head=c.head | o.head,
                     data=c.data or o.data, scalar=c.scalar and o.scalar)
               for c, o in zip(carry, outs)]
        if new == carry:
            break
        carry = new
    analysis.walk(cj, [*args[:cn], *carry], chain, (*idp, 0), dims)
    return carry


def interpret(walker: Walker, eqn, invals, chain, idp, fp8_local):
    p = eqn.params
    cn, bn = p["cond_nconsts"], p["body_nconsts"]
    (cj, cc), (bj, bc) = open_jaxpr(p["cond_jaxpr"]), open_jaxpr(p["body_jaxpr"])
    cconsts, bconsts = invals[:cn], invals[cn:cn + bn]
    dtypes = [v.aval.dtype for v in eqn.invars[cn + bn:]]
    init = [cast(x, d) for x, d in zip(invals[cn + bn:], dtypes)]

    def cond_fn(carry):
        args = [*cconsts, *carry]
        return walker.walk(cj, cc, args, [chain] * len(args), chain, (*idp, 0), fp8_local)[0]

    def body_fn(carry):
        args = [*bconsts, *carry]
        outs = walker.walk(bj, bc, args, [chain] * len(args), chain, (*idp, 1), fp8_local)
        return [cast(o, d) for o, d in zip(outs, dtypes)]

    walker.loop_depth += 1
    walker.loops.append((None, None))
    try:
        return list(lax.while_loop(cond_fn, body_fn, init))
    finally:
        walker.loop_depth -= 1
        walker.loops.pop()


WHILE = Handler(facts=facts, interpret=interpret)
