"""Which matmul operands are FP8 by provenance: an operand counts when it is an 8-bit (or
4-bit) float array, or comes from one through exact layout and widening steps only
(convert_element_type, reshape, transpose, broadcast, pad, slice...) and multiplications by
E8M0 scales (powers of two: exact; how fmtkit emulates an MX GEMM off GPUs), across the
boundaries of jit, custom_vjp, scan and cond bodies. A quantize-dequantize (an FP8 array
multiplied by an f32 scale before the dot) is not FP8: that multiply ends the chain."""

from __future__ import annotations

import jax
import jax.extend
import jax.numpy as jnp

MATMULS = ("dot_general", "ragged_dot_general")
# Steps that move or exactly widen values (an FP8 value widened to bf16/f32 is exact).
_LAYOUT = {"convert_element_type", "reshape", "transpose", "broadcast_in_dim", "squeeze",
           "expand_dims", "pad", "slice", "dynamic_slice", "copy", "copy_p", "concatenate",
           "rev", "select_n"}


FP8, E8M0 = "fp8", "e8m0"


def _narrow_float(aval) -> bool:
    dt = getattr(aval, "dtype", None)
    return dt is not None and jnp.issubdtype(dt, jnp.floating) and (
        jnp.dtype(dt).itemsize == 1) and dt != jnp.float8_e8m0fnu


def _kind(aval):
    if getattr(aval, "dtype", None) == jnp.float8_e8m0fnu:
        return E8M0
    return FP8 if _narrow_float(aval) else None


def _subjaxprs(eqn):
    return [getattr(j, "jaxpr", j) for j in jax.extend.core.jaxprs_in_params(eqn.params)]


def _walk(jaxpr, kinds_in: list, found: dict) -> list:
    """Propagates each value's kind (FP8, E8M0 or None) through ``jaxpr``."""
    env = {}

    def read(a):
        if not isinstance(a, jax.extend.core.Var):
            return None
        return env.get(a) or _kind(a.aval)

    env.update(zip(jaxpr.invars, kinds_in))
    for eqn in jaxpr.eqns:
        ins = [read(a) for a in eqn.invars]
        name = eqn.primitive.name
        if name in MATMULS:
            found[id(eqn)] = (ins[0] == FP8, ins[1] == FP8, eqn)
            outs = [None] * len(eqn.outvars)
        elif name in _LAYOUT:
            data = ins[1:] if name == "select_n" else ins if name == "concatenate" else ins[:1]
            same = data[0] if data and all(k == data[0] for k in data) else None
            outs = [same] * len(eqn.outvars)
        elif name == "optimization_barrier":  # passes each operand through unchanged
            outs = list(ins)
        elif name == "mul":
            outs = [FP8 if sorted(map(str, ins)) == [E8M0, FP8] else None]
        elif name == "cond":
            branch_outs = [_walk(getattr(b, "jaxpr", b), ins[1:], found)
                           for b in eqn.params["branches"]]
            outs = [col[0] if all(k == col[0] for k in col) else None
                    for col in zip(*branch_outs)]
        else:
            subs = _subjaxprs(eqn)
            outs = [None] * len(eqn.outvars)
            for sub in subs:
                if len(sub.invars) == len(ins):
                    res = _walk(sub, ins, found)
                    if len(res) == len(outs) and len(subs) == 1:
                        outs = res
                else:  # unknown structure: nothing inside counts as fed FP8
                    _walk(sub, [None] * len(sub.invars), found)
        env.update(zip(eqn.outvars, outs))
    return [read(v) for v in jaxpr.outvars]


def fp8_operands(closed_jaxpr) -> dict[int, tuple[bool, bool, object]]:
    """``id(eqn) -> (lhs is FP8, rhs is FP8, eqn)`` for every matmul of the jaxpr."""
    found: dict = {}
    jaxpr = closed_jaxpr.jaxpr
    _walk(jaxpr, [_kind(v.aval) for v in jaxpr.invars], found)
    return found
