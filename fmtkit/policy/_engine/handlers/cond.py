"""``cond``/``switch``: each branch interpreted; an output gets the widest of the dtypes the
branches give it (``lax.switch`` needs one type)."""

from __future__ import annotations

import functools

import jax
from jax import lax

from fmtkit.policy._engine.binding import cast, floating_dtype, wider
from fmtkit.policy._engine.walkers import Analyzer, Facts, Handler, Walker


def facts(analysis: Analyzer, eqn, args, chain, idp, dims):
    branches = [analysis.walk(br.jaxpr, args[1:], chain, (*idp, b), dims)
                for b, br in enumerate(eqn.params["branches"])]
    extra = args[0].dep
    return [Facts(param=all(f.param for f in col), const=all(f.const for f in col),
                  dep=extra.union(*(f.dep for f in col)),
                  head=frozenset().union(*(f.head for f in col)),
                  upcast=all(f.upcast for f in col), data=any(f.data for f in col),
                  scalar=all(f.scalar for f in col)) for col in zip(*branches)]


def interpret(walker: Walker, eqn, invals, chain, idp, fp8_local):
    ops = invals[1:]
    n = len(ops)

    def branch(b, br):
        def fn(*xs):
            return walker.walk(br.jaxpr, br.consts, list(xs), [chain] * n, chain,
                               (*idp, b), fp8_local)
        return fn

    fns = [branch(b, br) for b, br in enumerate(eqn.params["branches"])]
    record, walker.record = walker.record, None  # dtypes only: nothing recorded
    try:
        shapes = [jax.eval_shape(fn, *ops) for fn in fns]
    finally:
        walker.record = record
    targets = [functools.reduce(wider, [s[j].dtype for s in shapes])
               if all(floating_dtype(s[j].dtype) for s in shapes) else None
               for j in range(len(eqn.outvars))]

    def cast_outputs(fn):
        return lambda *xs: [o if t is None else cast(o, t) for o, t in zip(fn(*xs), targets)]

    return list(lax.switch(invals[0], [cast_outputs(fn) for fn in fns], *ops))


COND = Handler(facts=facts, interpret=interpret)
