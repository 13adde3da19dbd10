"""Walks a jaxpr and all its sub-jaxprs (custom_vjp, pjit, scan, cond bodies)."""

import dataclasses
import math
import re
from collections.abc import Iterator
from typing import Any

import jax
import jax.extend
import jax.numpy as jnp

from fmtkit.fp8 import WIDENED_SCOPE


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


def iter_eqns_with_trips(jaxpr, trips: int = 1) -> Iterator[tuple[Any, int]]:
    """``(equation, trips)`` for every equation of ``jaxpr``, recursively: ``trips`` is how
    many times it runs per call, the product of the lengths of the scans around it (one
    per other body)."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    for eqn in jaxpr.eqns:
        yield eqn, trips
        inner = trips * int(eqn.params.get("length", 1)) if eqn.primitive.name == "scan" \
            else trips
        for sub in _subjaxprs(eqn):
            yield from iter_eqns_with_trips(sub, inner)


def dot_operand_dtypes(closed_jaxpr, entered: bool = False) -> list[tuple]:
    """(lhs dtype, rhs dtype) of every dot_general, in order: the FP8 formats an emulated FP8
    GEMM computes in where its dot reads them widened (``fmtkit.fp8.WIDENED_SCOPE``), or with
    ``entered`` the dtypes that enter the dot."""
    return [tuple(v.aval.dtype for v in e.invars) if entered else operand_dtypes(e)
            for e in iter_eqns(closed_jaxpr) if e.primitive.name == "dot_general"]


def operand_dtypes(eqn) -> tuple:
    """A matmul equation's (lhs, rhs) dtypes, or the FP8 formats named by its
    ``fmtkit.fp8.WIDENED_SCOPE`` where an emulated FP8 GEMM reads them widened (off GPUs)."""
    widened = _WIDENED_RX.findall(str(eqn.source_info.name_stack))
    if widened:
        return tuple(jnp.dtype(d) for d in widened[-1])
    return tuple(v.aval.dtype for v in eqn.invars[:2])


# ---------------------------------------------------------------------------------------------
# Data-flow labels: which inputs each value depends on, through every sub-jaxpr.
#
# ``label_eqns`` propagates sets of labels from a jaxpr's inputs to every value: the policy
# checks seed "param" (trainable parameters), "data" (the batch) and "cotangent" (the seed of
# the backward pass, an explicit input of a ``jax.vjp`` pullback), which tells a forward matmul
# (no cotangent) from a backward one, and a weight operand (param only) from an activation.
# A matmul (``dot_general``, ``conv_general_dilated``) fed a cotangent and no weight adds its own
# label ``("mm", id)``, and drops the ``"mm"`` labels of its inputs: a gradient output carrying
# ``("mm", id)`` was reached from that matmul through no other matmul (a weight gradient).

PARAM, DATA, COTANGENT = "param", "data", "cotangent"
_WIDENED_RX = re.compile(re.escape(WIDENED_SCOPE) + r"-(\w+)-(\w+)")
MATMULS = ("dot_general", "conv_general_dilated", "ragged_dot_general")
_EMPTY = frozenset()


@dataclasses.dataclass(frozen=True)
class Labeled:
    """One equation with the labels of its inputs and outputs (its last propagation pass)."""

    eqn: Any
    ins: tuple[frozenset, ...]
    outs: tuple[frozenset, ...]


def _read(env, atom):
    return env.get(atom, _EMPTY) if isinstance(atom, jax.extend.core.Var) else _EMPTY


def _is_weight(labels: frozenset) -> bool:
    return PARAM in labels and DATA not in labels and COTANGENT not in labels


def _matmul_outs(eqn, ins):
    base = _drop_mm(_union(ins))
    if any(COTANGENT in s for s in ins[:2]) and not any(_is_weight(s) for s in ins[:2]):
        base = base | {("mm", id(eqn))}
    return [base] * len(eqn.outvars)


def _run(jaxpr, in_labels, record):
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    env = dict(zip(jaxpr.invars, in_labels))
    for eqn in jaxpr.eqns:
        ins = [_read(env, a) for a in eqn.invars]
        outs = _eqn_outs(eqn, ins, record)
        if record is not None:
            record.append(Labeled(eqn, tuple(ins), tuple(outs)))
        env.update(zip(eqn.outvars, outs))
    return [_read(env, v) for v in jaxpr.outvars]


def _union(sets):
    return frozenset().union(*sets)


def _drop_mm(labels: frozenset) -> frozenset:
    return frozenset(lab for lab in labels if not (isinstance(lab, tuple) and lab[0] == "mm"))


# Ops through which a matmul's output reaches a gradient only as a scale or a decision (an FP8
# amax, an overflow check), not as a value: its "mm" label stops there.
_SCALE_OPS = ("reduce_max", "reduce_min", "argmax", "argmin", "reduce_and", "reduce_or")


def _eqn_outs(eqn, ins, record):
    name = eqn.primitive.name
    if name in MATMULS:
        return _matmul_outs(eqn, ins)
    if name in _SCALE_OPS or (eqn.outvars and all(
            not jnp.issubdtype(getattr(v.aval, "dtype", jnp.float32), jnp.inexact)
            for v in eqn.outvars)):
        return [_drop_mm(_union(ins))] * len(eqn.outvars)
    if name == "scan":
        body = eqn.params["jaxpr"]
        if "num_consts" in eqn.params:
            nc, ncar = eqn.params["num_consts"], eqn.params["num_carry"]
            consts, carry, xs = ins[:nc], ins[nc:nc + ncar], ins[nc + ncar:]
        else:  # jax >= 0.9: the (consts, carry, xs) split is a flat tree of the inputs
            consts, carry, xs = (list(g) for g in eqn.params["ft_in"].update(ins).unpack())
            ncar = len(carry)
        while True:  # fixpoint: a carry's labels are those of its init and every iteration
            outs = _run(body, consts + carry + xs, None)
            new = [a | b for a, b in zip(carry, outs[:ncar])]
            if new == carry:
                break
            carry = new
        outs = _run(body, consts + carry + xs, record)
        return carry + outs[ncar:]
    if name == "while":
        cn, bn = eqn.params["cond_nconsts"], eqn.params["body_nconsts"]
        bconsts, carry = ins[cn:cn + bn], ins[cn + bn:]
        while True:
            outs = _run(eqn.params["body_jaxpr"], bconsts + carry, None)
            new = [a | b for a, b in zip(carry, outs)]
            if new == carry:
                break
            carry = new
        _run(eqn.params["body_jaxpr"], bconsts + carry, record)
        return carry
    if name == "cond":
        # Values flow from the branches' operands; the branch index only selects (a weight
        # passed through one branch stays a weight).
        outs = [_run(br, ins[1:], record) for br in eqn.params["branches"]]
        return [_union(col) for col in zip(*outs)]
    subs = list(jax.extend.core.jaxprs_in_params(eqn.params))
    if len(subs) == 1 and len(getattr(subs[0], "invars", ())) == len(ins) and \
            len(subs[0].outvars) == len(eqn.outvars):
        return _run(subs[0], ins, record)  # jit, remat, custom_jvp/vjp calls, closed_call
    everything = _union(ins)
    for sub in subs:  # unknown structure: every output may depend on every input
        _run(sub, [everything] * len(sub.invars), record)
    return [everything] * len(eqn.outvars)


def label_eqns(closed_jaxpr, in_labels) -> tuple[list[Labeled], list[frozenset]]:
    """Labels every equation of ``closed_jaxpr`` (recursively) from its inputs' labels.

    Args:
      closed_jaxpr: from ``jax.make_jaxpr``.
      in_labels: one iterable of labels per flat input (``jaxpr.invars`` order).

    Returns:
      ``(records, out_labels)``: every equation (sub-jaxprs included; a loop body once, with
      its fixpoint labels) and the labels of the jaxpr's outputs.
    """
    record: list[Labeled] = []
    outs = _run(closed_jaxpr.jaxpr, [frozenset(labs) for labs in in_labels], record)
    return record, outs


def matmul_flops(eqn) -> int:
    """2 x (output elements) x (contraction size) of a dot_general or convolution (a
    ragged_dot_general: its rows once, each with its group)."""
    out = eqn.outvars[0].aval
    lhs = eqn.invars[0].aval
    if eqn.primitive.name == "ragged_dot_general":
        # Ragged rows (each in one group): out [m, n] = 2 m n k; ragged contraction (the
        # weight gradient, out [g, k, n]): each group sums its own rows, 2 k n m in all.
        rd = eqn.params["ragged_dot_dimension_numbers"]
        (lhs_contract, _), _ = rd.dot_dimension_numbers
        contract = math.prod(lhs.shape[i] for i in lhs_contract)
        if set(rd.lhs_ragged_dimensions) & set(lhs_contract):
            groups = eqn.invars[2].aval.shape[-1]
            return 2 * math.prod(out.shape) // groups * contract
        return 2 * math.prod(out.shape) * contract
    if eqn.primitive.name in ("dot_general", "scaled_dot"):
        (lhs_contract, _), _ = eqn.params["dimension_numbers"]
        return 2 * math.prod(out.shape) * math.prod(lhs.shape[i] for i in lhs_contract)
    rhs = eqn.invars[1].aval
    out_feature_dim = eqn.params["dimension_numbers"].rhs_spec[0]
    return 2 * math.prod(out.shape) * math.prod(rhs.shape) // rhs.shape[out_feature_dim]


def matmul_role(rec: Labeled, head_size: int, weight_grads: frozenset) -> str:
    """What a labeled matmul computes.

    "head": an operand has the head's size (vocabulary / classes) among its dimensions.
    "conv_fwd" / "conv_bwd": a convolution in the forward / backward pass. "fwd": a forward
    matmul with a weight operand (a parameter, not mixed with data). "dgrad": a weight times
    a cotangent. "wgrad": a matmul of a cotangent and an activation whose result reaches a
    parameter gradient through no other matmul (``weight_grads``: the ``("mm", id)`` labels
    found on the gradient outputs).
    "act_fwd" / "act_bwd": activation x activation (attention) forward / backward.
    """
    eqn, (lhs, rhs) = rec.eqn, rec.ins[:2]
    if any(head_size in v.aval.shape for v in eqn.invars[:2]):
        return "head"
    weight = _is_weight(lhs) or _is_weight(rhs)
    backward = COTANGENT in lhs or COTANGENT in rhs
    if eqn.primitive.name == "conv_general_dilated":
        return "conv_bwd" if backward else "conv_fwd"
    if weight:
        return "dgrad" if backward else "fwd"
    if not backward:
        return "act_fwd"
    return "wgrad" if ("mm", id(eqn)) in weight_grads else "act_bwd"


@dataclasses.dataclass(frozen=True)
class Matmul:
    role: str
    dtypes: tuple[str, str]
    flops: int
    where: str  # the equation, for messages
    backward: bool = False  # fed the cotangent

    @property
    def fp8(self) -> bool:
        return all(jnp.dtype(d).itemsize == 1 and jnp.issubdtype(d, jnp.floating)
                   for d in self.dtypes)


def matmuls(records: list[Labeled], out_labels, head_size: int) -> list[Matmul]:
    """Every matmul of a labeled train-step jaxpr with its role, operand dtypes and FLOPs.

    ``out_labels``: labels of the jaxpr outputs that are parameter gradients.
    """
    weight_grads = _union(out_labels)
    found = []
    for rec in records:
        if rec.eqn.primitive.name in MATMULS:
            dts = tuple(str(v.aval.dtype) for v in rec.eqn.invars[:2])
            widened = _WIDENED_RX.findall(str(rec.eqn.source_info.name_stack))
            if widened:  # an FP8 GEMM whose dot reads widened operands (fmtkit.fp8)
                dts = widened[-1]
            shapes = " x ".join(str(v.aval.shape) for v in rec.eqn.invars[:2])
            found.append(Matmul(matmul_role(rec, head_size, weight_grads), dts,
                                matmul_flops(rec.eqn), f"{rec.eqn.primitive.name} {shapes}",
                                any(COTANGENT in s for s in rec.ins[:2])))
    return found


TRANSCENDENTALS = ("exp", "log", "log1p", "expm1", "rsqrt")
REDUCTIONS = ("reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "cumsum", "cumprod",
              "cummax", "cummin", "cumlogsumexp", "argmax", "argmin")


def non_f32_transcendentals(closed_jaxpr) -> list[str]:
    """``exp``/``log``/``log1p``/``expm1``/``rsqrt`` equations whose output is not f32."""
    return [f"{e.primitive.name} -> {e.outvars[0].aval.dtype}"
            for e in iter_eqns(closed_jaxpr) if e.primitive.name in TRANSCENDENTALS
            and e.outvars[0].aval.dtype != jnp.float32]


def low_precision_reductions(closed_jaxpr) -> list[str]:
    """Reductions (sums, maxima, cumulative ops, arg-reductions) of floats narrower than f32."""
    return [f"{e.primitive.name} of {e.invars[0].aval.dtype}{e.invars[0].aval.shape}"
            for e in iter_eqns(closed_jaxpr) if e.primitive.name in REDUCTIONS
            and jnp.issubdtype(e.invars[0].aval.dtype, jnp.floating)
            and jnp.dtype(e.invars[0].aval.dtype).itemsize < 4]


def compute_fraction(found: list[Matmul], dtype, *, backward: bool) -> float:
    """Fraction of the non-head matmul FLOPs (forward or backward) on two ``dtype`` operands."""
    roles = ("dgrad", "wgrad", "act_bwd", "conv_bwd") if backward else (
        "fwd", "act_fwd", "conv_fwd")
    sel = [m for m in found if m.role in roles]
    total = sum(m.flops for m in sel)
    good = sum(m.flops for m in sel if m.dtypes == (jnp.dtype(dtype).name,) * 2)
    return good / total if total else float("nan")


# ---------------------------------------------------------------------------------------------
# FP4 GEMMs (fmtkit.fp4): E2M1 operands widened to E4M3 inside the GEMM on XLA backends.


def _fp4_fed(eqn, producers, depth=8):
    """Whether each operand of ``eqn`` is an 8-bit (or narrower) array that comes from a
    float4_e2m1fn value through at most ``depth`` layout / widening equations (convert,
    reshape, pad, transpose, slice)."""
    passthrough = {"convert_element_type", "reshape", "pad", "transpose", "slice",
                   "broadcast_in_dim", "squeeze", "dynamic_slice", "copy",
                   "optimization_barrier"}

    def fed(var, d):
        if getattr(var.aval, "dtype", None) == jnp.float4_e2m1fn:
            return True
        src = producers.get(var) if isinstance(var, jax.extend.core.Var) else None
        if d == 0 or src is None:
            return False
        # A nested jit counts as layout when it keeps its operand's narrow dtype (XLA's
        # dynamic_index_in_dim, jnp.pad); anything else ends the chain.
        keeps = src.primitive.name == "jit" and src.outvars[0].aval.dtype == getattr(
            src.invars[0].aval, "dtype", None)
        if src.primitive.name not in passthrough and not keeps:
            return False
        return any(fed(v, d - 1) for v in src.invars if isinstance(v, jax.extend.core.Var))

    # The dot itself must take 8-bit-or-narrower operands: an E2M1 array widened to f32 and
    # dotted there would be a quantize-dequantize GEMM, not an FP4 one. Off GPUs fmtkit.fp8
    # widens the FP8 operands exactly to bf16 in its WIDENED_SCOPE: those may be wider.
    widened = bool(_WIDENED_RX.findall(str(eqn.source_info.name_stack)))
    return [(widened or jnp.dtype(v.aval.dtype).itemsize == 1) and fed(v, depth)
            for v in eqn.invars[:2]]


def fp4_gemms(closed_jaxpr) -> list[int]:
    """Contraction size of every dot_general (in any sub-jaxpr) fed FP4 operands on both sides;
    asserts no dot mixes an FP4 operand with a wider one."""
    out = []
    jaxprs = [closed_jaxpr.jaxpr] + [sub for e in iter_eqns(closed_jaxpr)
                                     for sub in _subjaxprs(e)]
    for jx in jaxprs:
        producers = {o: e for e in jx.eqns for o in e.outvars}
        for e in jx.eqns:
            if e.primitive.name != "dot_general":
                continue
            fed = _fp4_fed(e, producers)
            assert fed[0] == fed[1], e
            if fed[0]:
                (lc, _), _ = e.params["dimension_numbers"]
                out.append(math.prod(e.invars[0].aval.shape[d] for d in lc))
    return out


def pallas_kernel_names(jaxpr) -> list[str]:
    """Names of the Pallas kernels (``pallas_call`` / ``mpmd_map`` equations) in a jaxpr,
    searched recursively through sub-jaxprs (jit, custom_vmap, scan, ...)."""
    names = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in ("pallas_call", "mpmd_map"):
            names.append(eqn.params.get("name"))
        for val in eqn.params.values():
            for v in val if isinstance(val, (tuple, list)) else (val,):
                sub = getattr(v, "jaxpr", v)
                if hasattr(sub, "eqns"):
                    names += pallas_kernel_names(sub)
    return names
