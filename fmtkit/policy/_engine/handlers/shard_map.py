"""``shard_map``: the body interpreted, rebuilt with the same mesh, specs and manual axes."""

from __future__ import annotations

import jax

from fmtkit.policy._engine.jaxprs import open_jaxpr
from fmtkit.policy._engine.walkers import Analyzer, Handler, Walker


def facts(analysis: Analyzer, eqn, args, chain, idp, dims):
    return analysis.walk(open_jaxpr(eqn.params["jaxpr"])[0], args, chain, idp, dims)


def interpret(walker: Walker, eqn, invals, chain, idp, fp8_local):
    p = eqn.params
    body, consts = open_jaxpr(p["jaxpr"])

    def fn(*xs):
        return tuple(walker.walk(body, consts, list(xs), [chain] * len(xs), chain, idp,
                                 fp8_local))

    mapped = jax.shard_map(fn, mesh=p["mesh"], in_specs=tuple(p["in_specs"]),
                           out_specs=tuple(p["out_specs"]), check_vma=p["check_vma"],
                           axis_names=set(p["newly_manual_axes"]))
    return list(mapped(*invals))


SHARD_MAP = Handler(facts=facts, interpret=interpret)
