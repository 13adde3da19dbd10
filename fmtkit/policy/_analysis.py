"""The analysis of a trace: projections, the output head, round trips, delayed-FP8 slots.

One pass over the jaxpr, before it is interpreted, finds for every matmul whether one
operand is a view of a parameter (a *projection*, what FP8 recipes target: Dense,
DenseGeneral, Einsum, Linear, LinearGeneral, ``x @ w`` with a parameter), whether it is the
model's *output head* (by role, below), and the delayed-FP8 amax-history slots it needs (one
per projection per layer: inside a ``scan`` the slot gets a leading layer axis; a batched
projection, per-expert GEMMs ``"egcd,edf->egcf"``, one history per expert). It also marks
the author's round trips (below). A matmul with a one-hot operand (a comparison cast to
float: ``jax.nn.one_hot``) is an embedding lookup, not a projection. The facts are kept per
equation position (``idpath``) for the interpreter, which walks the same jaxpr in the same
order.

**The output head, by role.** A value "derives transparently" from a matmul when every op on
the way combines it only with constants, parameters (a bias) or values computed from the same
matmul (a log-softmax's ``x - logsumexp(x)``); a residual add of two independent streams
breaks the chain, and so does any other matmul. The matmuls that the model's outputs derive
from transparently, with a parameter operand, are the head: lm1b's ``logitdense``, a
tied-embedding ``attend``, a CNN's classifier, whatever their names. Where none of those
matmuls has a parameter operand, the ``dot_general`` of two activations without batch
dimensions is the head: CLIP's contrastive logits ``(image_emb @ text_emb.T) *
exp(logit_scale)`` (f32 logits before a scale of up to 100); attention's batched
``probs @ v`` is not, nor a hidden state times an input (a projection whose weight is passed
as data). A model whose output is a hidden state (past its last matmul) has no head.

Roles are stable under additions: the head is searched from the first floating output leaf
only (an auxiliary output, a dict of MoE metrics, never makes a second head), or from the
values passed to ``mark_head`` where the model calls it; a sum keeps the head's chain through
anything computed from parameters alone (an L2 penalty), and a sum of scalar loss terms takes
the head of its first term that has one (the main loss, written first; an aux loss from a
router or a probe adds no head). A value through ``stop_gradient`` (a frozen teacher's
logits in a distillation loss) derives from no head, so the KL term may come first; terms
from the output layers of two separate networks (no matmul feeds both: two trained models)
warn, naming ``mark_head``.

**Round trips.** ``x.astype(bf16)``, a dispatch, ``.astype(x.dtype)`` (MoE code saving
bandwidth) is not the author asking for f32: a widening cast back to the dtype a value had
before the author's own narrowing, in the same module and through anything but a projection,
restores the dtype the value had at that point of the policied run. Only a widening of a value
the model made narrow (a bf16 projection's output, a layer's ``dtype=bf16`` output cast,
bf16 parameters or inputs) is an upcast the policy keeps.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import jax.extend.core as jex
import numpy as np

from fmtkit.policy import _ops
from fmtkit.policy._binding import F32, floating_dtype
from fmtkit.policy._scopes import name_stack_scopes, scope_chain

if TYPE_CHECKING:
    from fmtkit.policy._interpreter import Interpreter

# Sums through which the head's chain passes scalar terms (``loss + aux_weight * aux_loss``).
_LOSS_SUMS = frozenset({"add", "sub", "add_any"})
# Ops after which a value derives from no head: a frozen teacher's logits
# (``jax.lax.stop_gradient``) are not the output of the model being trained.
_NO_HEAD = frozenset({"stop_gradient"})


@dataclasses.dataclass(frozen=True)
class _Facts:
    param: bool = False  # a view of a parameter
    const: bool = False  # depends on no floating input (literals, labels, iota)
    dep: frozenset = frozenset()  # every matmul upstream
    head: frozenset = frozenset()  # matmuls this value derives from transparently
    upcast: bool = False  # the author's cast of a narrower float to f32
    data: bool = False  # depends on a floating input that is not a parameter
    scalar: bool = False  # one element (a loss term, a metric), or a broadcast of one
    # (traced dtype, idpath, module chain) of the author's narrowing cast this value has been
    # through since (``x.astype(bf16)`` before a dispatch), None if it has not
    narrowed: tuple | None = None
    onehot: bool = False  # a one-hot encoding (a comparison cast to float), seen through views


@dataclasses.dataclass(frozen=True)
class DotInfo:
    """What the analysis knows of one matmul equation."""

    module: int | None  # registry index of the innermost module (None: outside modules)
    projection: bool  # an operand is a view of a parameter
    batched: bool  # dot_general with batch dimensions
    head: bool = False


_NO_FACTS = _Facts()


class Analysis:
    """Facts about the equations of one trace, keyed by their position (``idpath``)."""

    def __init__(self, closed: jex.ClosedJaxpr, param_inputs: Sequence[bool],
                 head_outputs: Sequence[bool], modules: Interpreter):
        self.dots: dict[tuple, DotInfo] = {}
        self.facts: dict[tuple, _Facts] = {}
        self.sites: dict[tuple, str] = {}  # idpath of a delayed-FP8 matmul -> slot name
        self.site_shapes: dict[str, tuple[int, ...]] = {}  # slot -> [*layers, *batch, 3, history]
        self.scan_sites: dict[tuple, list[str]] = {}  # idpath of a scan -> slots inside
        self._modules = modules  # module index -> path and Policy
        self._count: dict[str, int] = {}
        jaxpr = closed.jaxpr
        self._marked: set = set()  # head candidates of the values given to ``mark_head``
        self.marked = False  # whether the model called ``mark_head``
        # round-trip cast (a widening back to the dtype before the author's narrowing) ->
        # idpath of that narrowing cast
        self.round_trips: dict[tuple, tuple] = {}
        self._fwd_rule = 0  # depth of custom_vjp forward rules being walked
        # (head taken, heads of the later terms) of each sum of loss terms whose terms came
        # from different output layers
        self.ambiguous: list[tuple[frozenset, list[frozenset]]] = []
        self._upstream: dict[tuple, frozenset] = {}  # matmul -> the matmuls feeding it
        # dot_generals of two activations alike: both computed by matmuls, or both inputs
        self._activation_products: set[tuple] = set()
        ins = [_Facts(param=bool(p), const=not floating_dtype(v.aval.dtype),
                      data=floating_dtype(v.aval.dtype) and not p)
               for v, p in zip(jaxpr.invars, param_inputs)]
        outs = self._walk(jaxpr, ins, (), (), ())
        if self.marked:
            heads = frozenset(self._marked)
        else:  # the main output is the first floating output leaf; the rest are auxiliary
            first = next((f for f, h in zip(outs, head_outputs) if h), _NO_FACTS)
            heads = first.head
        # A projection (a parameter operand) is the head where one is found; else a matmul
        # of two activations without batch dimensions (CLIP's contrastive logits,
        # ``img @ txt.T * exp(scale)``; not attention's batched ``probs @ v``, nor a hidden
        # state times an input, a projection whose weight was passed as data).
        heads = ({d for d in heads if self.dots[d].projection}
                 or {d for d in heads if not self.dots[d].batched
                     and d in self._activation_products})
        self._warn_ambiguous(heads)
        for d in heads:
            self.dots[d] = dataclasses.replace(self.dots[d], head=True)
            if modules.head_applies(self.dots[d].module):  # the head stays out of FP8
                key = self.sites.pop(d, None)
                if key is not None:
                    self.site_shapes.pop(key)
        self.heads = frozenset(heads)

    def _warn_ambiguous(self, heads: set) -> None:
        """Warns when the head was chosen among loss terms from the output layers of two
        separate networks (no matmul feeds both: two trained models, a distillation teacher
        not under ``stop_gradient``). A probe or a router on the model's own features (an
        aux loss) shares the trunk: the first term's head is then the intended one."""
        if self.marked:
            return

        def upstream(ds):
            return frozenset().union(*(self._upstream.get(d, frozenset()) for d in ds))

        for taken, others in self.ambiguous:
            rest = frozenset().union(*others) - taken
            if not taken & heads or not upstream(taken) or not upstream(rest) \
                    or upstream(taken) & upstream(rest):
                continue

            def where(ds):
                return sorted({self._modules.path(self.dots[d].module) or "<root>"
                               for d in ds if d in self.dots})

            other = where(rest)
            warnings.warn(
                "with_policy: the loss adds terms computed from different output layers (the "
                f"matmuls in modules {where(taken)} and {other}); the first term's, in "
                f"{where(taken)}, is taken as the model's output head (f32 logits, never "
                "FP8). If that is not the trained model's output, call "
                "fmtkit.policy.mark_head(logits) on its logits; a frozen teacher's logits "
                "under jax.lax.stop_gradient never count.", UserWarning, stacklevel=2)
            return

    def is_head_value(self, idprefix: tuple, var) -> bool:
        facts = self.facts.get((idprefix, var))
        return bool(facts and facts.head & self.heads)

    def is_param(self, idprefix: tuple, var) -> bool:
        facts = self.facts.get((idprefix, var))
        return bool(facts and facts.param)

    def is_upcast(self, idprefix: tuple, var) -> bool:
        facts = self.facts.get((idprefix, var))
        return bool(facts and facts.upcast)

    def _new_site(self, module: int | None, dims: tuple[int, ...], history: int) -> str:
        path = self._modules.path(module)
        n = self._count.get(path, 0)
        self._count[path] = n + 1
        key = f"{path or '<root>'}:dot{n}"
        self.site_shapes[key] = (*dims, 3, history)
        return key

    def _walk(self, jaxpr, ins: list[_Facts], prefix: tuple, idprefix: tuple,
              dims: tuple[int, ...]) -> list[_Facts]:
        env: dict[Any, _Facts] = {}
        for v, f in zip(jaxpr.invars, ins):
            env[v] = f
            self.facts[(idprefix, v)] = f
        for v in jaxpr.constvars:
            env[v] = _Facts(const=True)

        def get(v):
            if isinstance(v, jex.Literal):
                return _Facts(const=True)
            return env.get(v, _NO_FACTS)

        for i, eqn in enumerate(jaxpr.eqns):
            idp = (*idprefix, i)
            chain = scope_chain(eqn, prefix)
            args = [get(v) for v in eqn.invars]
            outs = self._eqn(eqn, args, chain, idp, dims)
            for v, f in zip(eqn.outvars, outs):
                env[v] = f
                self.facts[(idprefix, v)] = f
        return [get(v) for v in jaxpr.outvars]

    def _eqn(self, eqn, args: list[_Facts], chain, idp, dims) -> list[_Facts]:
        name = eqn.primitive.name
        dep = frozenset().union(*(a.dep for a in args))
        const = all(a.const for a in args)
        n_out = len(eqn.outvars)
        data = any(a.data for a in args)
        narrowed = next((a.narrowed for a in args if a.narrowed is not None), None)
        _, marks_head, nested = name_stack_scopes(eqn.source_info.name_stack)
        if marks_head:
            self.marked = True
            self._marked.update(*(a.head for a in args))
        if nested:  # an inner policied function's op: its own policy decided it
            return [_Facts(dep=dep, const=const, data=data)] * n_out
        if name in _ops.INLINE_CALLS:
            return self._walk(eqn.params["jaxpr"].jaxpr, args, chain, idp, dims)
        if name == "custom_jvp_call":
            return self._walk(eqn.params["call_jaxpr"].jaxpr, args, chain, idp, dims)
        if name in _ops.REMAT:
            return self._walk(eqn.params["jaxpr"], args, chain, idp, dims)
        if name == "scan" and scan_counts(eqn) is not None:
            n0, n1, _ = scan_counts(eqn)
            body = [a if not (n0 <= j < n0 + n1) else _Facts(dep=a.dep, data=a.data)
                    for j, a in enumerate(args)]
            before = set(self.sites.values())
            inner = self._walk(eqn.params["jaxpr"].jaxpr, body, chain, idp,
                               (*dims, int(eqn.params["length"])))
            self.scan_sites[idp] = [k for k in self.sites.values() if k not in before]
            dep = dep.union(*(f.dep for f in inner))
            return [_Facts(dep=dep, const=const, data=data)] * n_out
        if name in _ops.MATMUL:
            (_lc, _rc), (lb, _) = (eqn.params["dimension_numbers"] if name == "dot_general"
                                 else (((), ()), ((), ())))
            module = chain[-1] if chain else None
            # A one-hot operand makes the matmul an embedding lookup (T5X's
            # ``Embed(one_hot=True)``, a relative-position bias table), not a projection: it
            # stays out of FP8, as a gather would.
            info = DotInfo(module, any(a.param for a in args[:2])
                           and not any(a.onehot for a in args[:2]), bool(lb))
            self.dots[idp] = info
            if name == "dot_general" and bool(args[0].dep) == bool(args[1].dep):
                self._activation_products.add(idp)
            self._upstream[idp] = dep
            policy = self._modules.policy_of(module)
            if (policy is not None and policy.fp8 is not None and policy.fp8.delayed
                    and name == "dot_general" and info.projection):
                # A batched projection (per-expert GEMMs) has one history per batch element.
                batch = tuple(int(eqn.invars[0].aval.shape[d]) for d in lb)
                self.sites[idp] = self._new_site(module, (*dims, *batch), policy.fp8.history)
            # A projection makes a new value; a matmul of activations (a dispatch einsum)
            # moves the narrowed value along.
            return [_Facts(dep=dep | {idp}, head=frozenset({idp}), data=data,
                           narrowed=None if info.projection else narrowed)] * n_out
        body = BODIES.get(name)
        if body is not None:
            outs = getattr(self, body)(eqn, args, chain, idp, dims)
            if outs is not None:
                return outs
        if list(jex.jaxprs_in_params(eqn.params)):  # pallas_call, unknown bodies: opaque
            return [_Facts(dep=dep, const=const, data=data)] * n_out
        heads = frozenset().union(*(a.head for a in args))
        if name in _NO_HEAD:
            heads = frozenset()
        if heads:
            # A value stays on the head's chain when combined with constants, parameters or
            # anything computed from parameters alone (an L2 penalty), values downstream of
            # the same matmul, and, in a sum, scalar terms (an aux loss, a metric).
            term = name in _LOSS_SUMS
            if term and all(a.scalar for a in args):
                # A sum of loss terms: the head comes from the first term that has one (the
                # main loss written first; an aux loss from another projection adds none).
                # Terms with different heads (a second trained model's loss) make the choice
                # ambiguous: reported once the analysis is done.
                found = [a.head for a in args if a.head]
                heads = found[0] if found else frozenset()
                if any(h != heads for h in found[1:]):
                    self.ambiguous.append((heads, found[1:]))
            else:
                heads = frozenset(d for d in heads
                                  if all(a.const or a.param or not a.data or d in a.dep
                                         or (term and a.scalar) for a in args))
        view = name in _ops.VIEW_OPS and bool(args)
        param = view and args[0].param
        # The author's upcast of an activation (``y.astype(jnp.float32)``), seen through views;
        # a parameter upcast by promotion (bf16 weights meeting f32 inputs) is not one.
        upcast = not param and ((view and args[0].upcast) or (
            name == "convert_element_type" and eqn.params["new_dtype"] == F32
            and floating_dtype(eqn.invars[0].aval.dtype)
            and np.dtype(eqn.invars[0].aval.dtype).itemsize < 4))
        if name == "convert_element_type" and floating_dtype(eqn.invars[0].aval.dtype) \
                and floating_dtype(eqn.params["new_dtype"]):
            src, dst = np.dtype(eqn.invars[0].aval.dtype), np.dtype(eqn.params["new_dtype"])
            if dst.itemsize < src.itemsize and not param:  # the author narrows an activation
                narrowed = narrowed or (src, idp, chain)
            elif dst.itemsize > src.itemsize and narrowed is not None:
                # Back to its own earlier dtype, in the module that narrowed it: a round trip.
                # (A layer's own output cast, LayerNorm(dtype=bf16), then the caller's
                # ``.astype(f32)``, is a value the model made narrow: an upcast.)
                if dst == narrowed[0] and chain == narrowed[2]:
                    self.round_trips[idp] = narrowed[1]
                    upcast = False
                narrowed = None
        onehot = (view and args[0].onehot) or _is_onehot_cast(eqn)
        outs = []
        for v in eqn.outvars:
            floating = floating_dtype(v.aval.dtype)
            scalar = int(np.prod(getattr(v.aval, "shape", ()))) == 1 or (view and args[0].scalar)
            outs.append(_Facts(param=param, const=const, dep=dep,
                               head=heads if floating else frozenset(), upcast=upcast,
                               data=data, scalar=scalar,
                               narrowed=narrowed if floating else None,
                               onehot=onehot and floating))
        return outs

    # -- bodies of control flow (see ``BODIES``); each walks what the Interpreter runs ------
    def _cond_facts(self, eqn, args, chain, idp, dims):
        branches = [self._walk(br.jaxpr, args[1:], chain, (*idp, b), dims)
                    for b, br in enumerate(eqn.params["branches"])]
        extra = args[0].dep
        return [_Facts(param=all(f.param for f in col), const=all(f.const for f in col),
                       dep=extra.union(*(f.dep for f in col)),
                       head=frozenset().union(*(f.head for f in col)),
                       upcast=all(f.upcast for f in col), data=any(f.data for f in col),
                       scalar=all(f.scalar for f in col)) for col in zip(*branches)]

    def _while_facts(self, eqn, args, chain, idp, dims):
        """A carry's facts hold for its initial value and every iteration's: the body is
        walked to a fixpoint (a generate loop's logits, written into a buffer the loop
        returns, make its head), its delayed-FP8 slots created by the last walk only."""
        cn, bn = eqn.params["cond_nconsts"], eqn.params["body_nconsts"]
        cj, bj = open_jaxpr(eqn.params["cond_jaxpr"])[0], open_jaxpr(eqn.params["body_jaxpr"])[0]
        carry = [_Facts(const=a.const, dep=a.dep, head=a.head, data=a.data, scalar=a.scalar)
                 for a in args[cn + bn:]]
        saved = dict(self.sites), dict(self.site_shapes), dict(self._count)
        for _ in range(8):  # facts only grow (sets, and const turning False): few rounds
            self.sites, self.site_shapes, self._count = (dict(d) for d in saved)
            outs = self._walk(bj, [*args[cn:cn + bn], *carry], chain, (*idp, 1), dims)
            new = [_Facts(const=c.const and o.const, dep=c.dep | o.dep, head=c.head | o.head,
                          data=c.data or o.data, scalar=c.scalar and o.scalar)
                   for c, o in zip(carry, outs)]
            if new == carry:
                break
            carry = new
        self._walk(cj, [*args[:cn], *carry], chain, (*idp, 0), dims)
        return carry

    def _shard_map_facts(self, eqn, args, chain, idp, dims):
        return self._walk(open_jaxpr(eqn.params["jaxpr"])[0], args, chain, idp, dims)

    def _custom_vjp_facts(self, eqn, args, chain, idp, dims):
        if self._fwd_rule:  # inside a forward rule: its primal (see Interpreter._custom_vjp)
            body, _ = open_jaxpr(eqn.params["call_jaxpr"])
            return self._walk(body, args, chain, idp, dims)
        parts = self._modules.vjp_parts(eqn)
        if parts is None:
            return None
        self._fwd_rule += 1
        try:
            outs = self._walk(parts.fwd, args[parts.num_consts:], chain, idp, dims)
        finally:
            self._fwd_rule -= 1
        return outs[parts.num_res:]


# Primitives holding a body that the policy interprets: name -> handler (``Analysis`` method
# ``<handler>_facts``, ``Interpreter`` method ``_<handler>``). ``jit``, ``scan``, ``remat``
# and ``custom_jvp`` are dispatched before (they were first). Any other primitive with a body
# runs as traced, with one warning per module and primitive.
BODIES = {
    "cond": "_cond_facts", "while": "_while_facts", "shard_map": "_shard_map_facts",
    "custom_vjp_call": "_custom_vjp_facts",
}


def _is_onehot_cast(eqn) -> bool:
    """A comparison's booleans cast to float: a one-hot encoding (``jax.nn.one_hot``)."""
    return (eqn.primitive.name == "convert_element_type"
            and eqn.invars[0].aval.dtype == np.bool_
            and floating_dtype(eqn.params["new_dtype"]))


def open_jaxpr(jaxpr) -> tuple[Any, Sequence[Any]]:
    """(open jaxpr, consts) of a Jaxpr or ClosedJaxpr parameter."""
    if isinstance(jaxpr, jex.ClosedJaxpr):
        return jaxpr.jaxpr, jaxpr.consts
    return jaxpr, ()


@functools.lru_cache(maxsize=256)
def holds_matmul(jaxpr) -> bool:
    """Whether a jaxpr (or any body inside it) has a matmul."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in _ops.MATMUL:
            return True
        if any(holds_matmul(open_jaxpr(sub)[0]) for sub in jex.jaxprs_in_params(eqn.params)):
            return True
    return False


@dataclasses.dataclass(frozen=True)
class VjpParts:
    """A ``custom_vjp_call`` taken apart: the user's forward rule as a jaxpr (inputs: the
    primal inputs after ``num_consts`` consts; outputs: ``num_res`` residuals, then the
    primal outputs), which residuals are forwarded inputs, and the user's backward rule."""

    fwd: Any
    fwd_consts: Sequence[Any]
    num_consts: int
    num_res: int
    forwarded: tuple[int | None, ...]  # per residual: the input it is, or None (computed)
    bwd: Any


def vjp_parts(eqn) -> VjpParts | None:
    """JAX keeps a custom VJP's forward rule as a thunk that traces it (``fwd_jaxpr_thunk``,
    called as JAX's own ``lift_fwd`` does) and the backward as a flat function of (residuals,
    cotangents) -> (input cotangents, logs): private structure, so None (the primitive then
    runs as traced, with a warning) if it is not what jax 0.11 has."""
    try:
        p = eqn.params
        nc = int(p["num_consts"])
        nonzero = [floating_dtype(v.aval.dtype) for v in eqn.invars[nc:]]
        fwd, consts = p["fwd_jaxpr_thunk"].call_wrapped(*nonzero)
        _, res_tree, forwarded = p["out_trees"]()
        num_res = res_tree.num_leaves - sum(f is not None for f in forwarded)
        if len(fwd.outvars) != num_res + len(eqn.outvars) or len(fwd.invars) != len(nonzero):
            return None
        return VjpParts(fwd, tuple(consts), nc, num_res, tuple(forwarded), p["bwd"])
    except Exception:  # any change of JAX's internals: run as traced (and warn)
        return None


def scan_counts(eqn) -> tuple[int, int, int] | None:
    """(consts, carry, xs) operand counts of a ``scan`` equation, or None if unknown."""
    try:
        n0, n1, n2 = (len(group) for group in eqn.params["ft_in"].elts)
    except (KeyError, AttributeError, TypeError, ValueError):
        return None
    if n0 + n1 + n2 != len(eqn.invars):
        return None
    if len(eqn.params["jaxpr"].jaxpr.outvars) != len(eqn.outvars):
        return None
    return n0, n1, n2

