"""Call primitives: a nested ``jit``/``pjit`` (kept as a ``jit`` with its shardings),
``closed_call``/``core_call`` (inlined) and ``remat`` (``jax.checkpoint``, ``nn.remat``,
``nnx.remat``: rebuilt as a ``jax.checkpoint`` with the user's policy)."""

from __future__ import annotations

import jax

from fmtkit.policy._engine.walkers import Analyzer, Handler, Walker


def call_facts(analysis: Analyzer, eqn, args, chain, idp, dims):
    return analysis.walk(eqn.params["jaxpr"].jaxpr, args, chain, idp, dims)


def call_interpret(walker: Walker, eqn, invals, chain, idp, fp8_local):
    """A nested ``jit`` is kept as a ``jit`` of its interpreted body, with the same
    ``in_shardings``/``out_shardings`` (inlining it changed XLA's fusion of the
    gradient: ~1e-7 differences under "fp32"); other call primitives are inlined."""
    inner = eqn.params["jaxpr"]

    def body(*xs):
        return tuple(walker.walk(inner.jaxpr, inner.consts, list(xs), [chain] * len(xs),
                                 chain, idp, fp8_local))

    if eqn.primitive.name not in ("pjit", "jit"):
        return list(body(*invals))
    p = eqn.params
    jitted = jax.jit(body, in_shardings=tuple(p["in_shardings"]),
                     out_shardings=tuple(p["out_shardings"]),
                     keep_unused=p["keep_unused"])
    jitted.__name__ = p.get("name", "jit")  # for the jaxpr's readers
    return list(jitted(*invals))


def remat_facts(analysis: Analyzer, eqn, args, chain, idp, dims):
    return analysis.walk(eqn.params["jaxpr"], args, chain, idp, dims)


def remat_interpret(walker: Walker, eqn, invals, chain, idp, fp8_local):
    """The body interpreted inside a ``jax.checkpoint`` with the traced ``prevent_cse`` and
    the user's policy, FP8 GEMM outputs asked about as the matmuls they replace
    (``Interpreter.remat_policy``)."""
    body = eqn.params["jaxpr"]

    def fn(*xs):
        return walker.walk(body, (), list(xs), [chain] * len(xs), chain, idp, fp8_local)

    return jax.checkpoint(fn, prevent_cse=eqn.params["prevent_cse"],
                          policy=walker.remat_policy(eqn.params["policy"]))(*invals)


CALL = Handler(facts=call_facts, interpret=call_interpret)
REMAT = Handler(facts=remat_facts, interpret=remat_interpret)
