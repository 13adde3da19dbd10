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
import warnings
from collections.abc import Sequence
from typing import Any

import jax.extend.core as jex
import numpy as np

from fmtkit._switches import SWITCHES
from fmtkit.policy import _ops
from fmtkit.policy._engine.handlers import TABLE
from fmtkit.policy._engine.jaxprs import F32, VjpParts, floating_dtype, has_body
from fmtkit.policy._engine.scopes import name_stack_scopes, scope_chain
from fmtkit.policy._engine.walkers import Facts, Resolver

# Sums through which the head's chain passes scalar terms (``loss + aux_weight * aux_loss``).
_LOSS_SUMS = frozenset({"add", "sub", "add_any"})
# Ops after which a value derives from no head: a frozen teacher's logits
# (``jax.lax.stop_gradient``) are not the output of the model being trained.
_NO_HEAD = frozenset({"stop_gradient"})


@dataclasses.dataclass(frozen=True)
class DotInfo:
    """What the analysis knows of one matmul equation."""

    module: int | None  # registry index of the innermost module (None: outside modules)
    projection: bool  # an operand is a view of a parameter
    batched: bool  # dot_general with batch dimensions
    head: bool = False


_NO_FACTS = Facts()


class Analysis:
    """Facts about the equations of one trace, keyed by their position (``idpath``)."""

    def __init__(self, closed: jex.ClosedJaxpr, param_inputs: Sequence[bool],
                 head_outputs: Sequence[bool], modules: Resolver):
        self.dots: dict[tuple, DotInfo] = {}
        self.facts: dict[tuple, Facts] = {}
        self.sites: dict[tuple, str] = {}  # idpath of a delayed-FP8 matmul -> slot name
        self.site_shapes: dict[str, tuple[int, ...]] = {}  # slot -> [*layers, *batch, 3, history]
        self.scan_sites: dict[tuple, list[str]] = {}  # idpath of a scan -> slots inside
        self._modules = modules  # module index -> path and Policy
        self.counts: dict[str, int] = {}
        jaxpr = closed.jaxpr
        self._marked: set = set()  # head candidates of the values given to ``mark_head``
        self.marked = False  # whether the model called ``mark_head``
        # round-trip cast (a widening back to the dtype before the author's narrowing) ->
        # idpath of that narrowing cast
        self.round_trips: dict[tuple, tuple] = {}
        self.fwd_rule = 0  # depth of custom_vjp forward rules being walked
        # (head taken, heads of the later terms) of each sum of loss terms whose terms came
        # from different output layers
        self.ambiguous: list[tuple[frozenset, list[frozenset]]] = []
        self._upstream: dict[tuple, frozenset] = {}  # matmul -> the matmuls feeding it
        # dot_generals of two activations alike: both computed by matmuls, or both inputs
        self._activation_products: set[tuple] = set()
        ins = [Facts(param=bool(p), const=not floating_dtype(v.aval.dtype),
                      data=floating_dtype(v.aval.dtype) and not p)
               for v, p in zip(jaxpr.invars, param_inputs)]
        outs = self.walk(jaxpr, ins, (), (), ())
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
        n = self.counts.get(path, 0)
        self.counts[path] = n + 1
        key = f"{path or '<root>'}:dot{n}"
        self.site_shapes[key] = (*dims, 3, history)
        return key

    def walk(self, jaxpr, ins: list[Facts], prefix: tuple, idprefix: tuple,
             dims: tuple[int, ...]) -> list[Facts]:
        env: dict[Any, Facts] = {}
        for v, f in zip(jaxpr.invars, ins):
            env[v] = f
            self.facts[(idprefix, v)] = f
        for v in jaxpr.constvars:
            env[v] = Facts(const=True)

        def get(v):
            if isinstance(v, jex.Literal):
                return Facts(const=True)
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

    def _eqn(self, eqn, args: list[Facts], chain, idp, dims) -> list[Facts]:
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
            return [Facts(dep=dep, const=const, data=data)] * n_out
        handler = TABLE.get(name)
        if handler is not None:
            outs = handler.facts(self, eqn, args, chain, idp, dims)
            if outs is not None:
                return outs
            return [Facts(dep=dep, const=const, data=data)] * n_out  # opaque
        if _ops.is_matmul(name):
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
            return [Facts(dep=dep | {idp}, head=frozenset({idp}), data=data,
                           narrowed=None if info.projection else narrowed)] * n_out
        if has_body(eqn):  # pallas_call, unknown bodies: opaque
            return [Facts(dep=dep, const=const, data=data)] * n_out
        heads = frozenset().union(*(a.head for a in args))
        if name in _NO_HEAD and SWITCHES.stop_gradient_ends_head:
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
            outs.append(Facts(param=param, const=const, dep=dep,
                               head=heads if floating else frozenset(), upcast=upcast,
                               data=data, scalar=scalar,
                               narrowed=narrowed if floating else None,
                               onehot=onehot and floating))
        return outs

    def vjp_parts(self, eqn) -> VjpParts | None:
        return self._modules.vjp_parts(eqn)


def _is_onehot_cast(eqn) -> bool:
    """A comparison's booleans cast to float: a one-hot encoding (``jax.nn.one_hot``)."""
    return (SWITCHES.onehot_lookups and eqn.primitive.name == "convert_element_type"
            and eqn.invars[0].aval.dtype == np.bool_
            and floating_dtype(eqn.params["new_dtype"]))
