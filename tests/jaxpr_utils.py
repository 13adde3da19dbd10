"""Walks a jaxpr and all its sub-jaxprs (custom_vjp, pjit, scan, cond bodies)."""

from collections.abc import Iterator

import jax
import jax.extend


def _subjaxprs(eqn) -> Iterator:
    for v in eqn.params.values():
        vals = v if isinstance(v, tuple | list) else (v,)
        for item in vals:
            if isinstance(item, jax.extend.core.ClosedJaxpr):
                yield item.jaxpr
            elif isinstance(item, jax.extend.core.Jaxpr):
                yield item


def iter_eqns(jaxpr) -> Iterator:
    """Every equation of ``jaxpr`` (a Jaxpr or ClosedJaxpr), recursively."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in _subjaxprs(eqn):
            yield from iter_eqns(sub)


def dot_operand_dtypes(closed_jaxpr) -> list[tuple]:
    """(lhs dtype, rhs dtype) of every dot_general, in order."""
    return [tuple(v.aval.dtype for v in e.invars) for e in iter_eqns(closed_jaxpr)
            if e.primitive.name == "dot_general"]
