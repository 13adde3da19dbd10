"""Operation-level policies: the traced jaxpr of a model, re-interpreted with precision rules.

How ``with_policy`` works, for a linen model, an NNX model and a plain function alike:

1. **Trace.** The unmodified model runs once under ``jax.make_jaxpr`` in its own dtypes. Each
   Flax module call is wrapped in a named scope ``fmtkit_module_<i>`` (linen:
   ``nn.intercept_methods``; NNX: the traced copy's classes are swapped for subclasses whose
   methods enter the scope), and a ``Registry`` maps ``i`` to the module's path and class
   names. Every equation's name stack then says which modules wrote it, innermost last, even
   inside ``jit``, ``scan`` and ``remat`` bodies. The trace is kept per input signature
   (``_trace_cache``), so a second trace of the same call only re-interprets it.
2. **Analyze** (``analyze``). One pass over the jaxpr finds, for every matmul: whether one
   operand is a view of a parameter (a *projection*, what FP8 recipes target: Dense,
   DenseGeneral, Einsum, Linear, LinearGeneral, ``x @ w`` with a parameter), whether it is the
   model's *output head* (by role, below), and the delayed-FP8 amax-history slots it needs
   (one per projection per layer: inside a ``scan`` the slot gets a leading layer axis; a
   batched projection, per-expert GEMMs ``"egcd,edf->egcf"``, one history per expert).
3. **Interpret** (``Interpreter``). Every equation is bound again with the dtypes the rules
   give it (op classes in ``_ops``): matmuls on the compute dtype (or the FP8 recipe),
   precision-sensitive ops in f32, the rest following their inputs; module outputs are cast to
   the module's ``output_dtype`` and their cotangents rounded through ``grad_dtype``. The
   interpretation is ordinary JAX code, so ``jit``, ``grad`` and ``vmap`` around it work and
   the backward pass is JAX's own transpose of the policied forward pass. Every primitive
   that holds a body is interpreted and rebuilt: ``jit`` (kept as a ``jit`` with its
   shardings), ``scan``, ``remat``, ``custom_jvp`` (the tangent is the original rule's),
   ``cond``/``switch`` (outputs in the widest dtype the branches give), ``while`` (the carry
   in its traced dtypes), ``shard_map`` (same mesh and specs), ``custom_vjp`` (the user's
   forward rule interpreted; the user's backward rule on residuals and cotangents in their
   traced dtypes). Any other body (``pallas_call``, a primitive this module does not know)
   runs as traced, inputs cast back, with one warning per module and primitive. Each
   rebuilt equation is bound through a ``jit`` shared by equal equations (``_bind``), as
   ``jnp`` binds its operators: under ``jax.grad`` it is linearized once, not per bind.

Why re-interpretation rather than intercepting ``Primitive.bind`` as the model runs (qwix's
way): changing a dtype while user code still runs breaks its Python-level dtype logic
(``jnp`` promotion raises under ``jax_numpy_dtype_promotion="strict"`` and silently widens
under "standard"; ``lax.scan`` rejects a carry whose dtype changed), and needs no private JAX
API patched. On a finished trace every dtype decision is the policy's.

**The output head, by role.** A value "derives transparently" from a matmul when every op on
the way combines it only with constants, parameters (a bias) or values computed from the same
matmul (a log-softmax's ``x - logsumexp(x)``); a residual add of two independent streams
breaks the chain, and so does any other matmul. The matmuls that the model's outputs derive
from transparently, with a parameter operand, are the head: lm1b's ``logitdense``, a
tied-embedding ``attend``, a CNN's classifier, whatever their names. A model whose output is
a hidden state has no head.

Roles are stable under additions: the head is searched from the first floating output leaf
only (an auxiliary output, a dict of MoE metrics, never makes a second head), or from the
values passed to ``mark_head`` where the model calls it; a sum keeps the head's chain through
anything computed from parameters alone (an L2 penalty), and a sum of scalar loss terms takes
the head of its first term that has one (the main loss, written first; an aux loss from a
router or a probe adds no head).

**Round trips.** ``x.astype(bf16)``, a dispatch, ``.astype(x.dtype)`` (MoE code saving
bandwidth) is not the author asking for f32: a widening cast back to the dtype a value had
before the author's own narrowing, in the same module and through anything but a projection,
restores the dtype the value had at that point of the policied run. Only a widening of a value
the model made narrow (a bf16 projection's output, a layer's ``dtype=bf16`` output cast,
bf16 parameters or inputs) is an upcast the policy keeps.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import re
import threading
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np
from jax import lax

from fmtkit import fp8
from fmtkit.policy import _ops, _trace_cache
from fmtkit.policy._policy import Policy, Rules, ancestor_types
from fmtkit.scaling import DelayedScalingState

MODULE_SCOPE = "fmtkit_module_"
OP_SCOPE = "fmtkit_op_"
GRAD_SCOPE = "fmtkit_grad_round_"
HEAD_SCOPE = "fmtkit_head_output"
_MODULE_RX = re.compile(MODULE_SCOPE + r"(\d+)")
# Sums through which the head's chain passes scalar terms (``loss + aux_weight * aux_loss``).
_LOSS_SUMS = frozenset({"add", "sub", "add_any"})
_F32 = np.dtype(np.float32)

# ---------------------------------------------------------------------------------------------
# Module registry and scopes (filled while the model is traced).


@dataclasses.dataclass(frozen=True)
class ModuleInfo:
    """A module the trace called: its path ("" for the root) and class names (most derived
    first), which rules match against."""

    path: str
    type_names: tuple[str, ...]


class Registry:
    """The modules seen during one trace; index ``i`` is scope ``fmtkit_module_<i>``."""

    def __init__(self):
        self.modules: list[ModuleInfo] = []
        self._index: dict[ModuleInfo, int] = {}

    def index(self, path: str, type_names: Sequence[str]) -> int:
        info = ModuleInfo(path, tuple(type_names))
        if info not in self._index:
            self._index[info] = len(self.modules)
            self.modules.append(info)
        return self._index[info]

    def chain(self, path: str) -> tuple[int, ...]:
        """The scope chain of the module at ``path`` (its ancestors' indices, then its own),
        as the equations it runs carry it: where a value it sows is read."""
        first: dict[str, int] = {}
        for i, m in enumerate(self.modules):
            first.setdefault(m.path, i)
        parts = path.split("/") if path else []
        prefixes = ["", *("/".join(parts[:k]) for k in range(1, len(parts) + 1))]
        return tuple(first[p] for p in prefixes if p in first)

    def visited(self) -> dict[str, tuple[str, ...]]:
        """``{path: class names}`` of every module called (for unmatched-rule reports)."""
        return {m.path: m.type_names for m in self.modules}


@dataclasses.dataclass
class OpRecord:
    """One interpreted equation, for ``inspect_policy``: scope ``fmtkit_op_<index>``."""

    path: str
    type_name: str
    policy: Policy | None
    primitive: str
    head: bool = False
    projection: bool = False
    param_operands: tuple[int, ...] = ()
    operand_shapes: tuple[tuple[int, ...], ...] = ()


@dataclasses.dataclass
class Recorder:
    """What ``inspect_policy`` collects while a policied model is traced."""

    ops: list[OpRecord] = dataclasses.field(default_factory=list)
    exits: dict[str, set] = dataclasses.field(default_factory=dict)  # path -> output dtypes
    modules: dict[str, tuple[str, Policy | None]] = dataclasses.field(default_factory=dict)
    opaque: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # (path, prim)


class _Active(threading.local):
    registry: Registry | None = None
    recorder: Recorder | None = None


_ACTIVE = _Active()


@contextlib.contextmanager
def tracing(registry: Registry):
    """Makes ``module_scope`` record into ``registry`` (for the duration of one trace)."""
    prev = _ACTIVE.registry
    _ACTIVE.registry = registry
    try:
        yield registry
    finally:
        _ACTIVE.registry = prev


@contextlib.contextmanager
def recording():
    """Records every interpreted op and module exit (for ``inspect_policy``)."""
    prev = _ACTIVE.recorder
    _ACTIVE.recorder = rec = Recorder()
    try:
        yield rec
    finally:
        _ACTIVE.recorder = prev


def is_tracing() -> bool:
    """Whether a policied trace is being recorded on this thread."""
    return _ACTIVE.registry is not None


def module_scope(path: str, type_names: Sequence[str]):
    """The named scope of one module call (a no-op outside ``tracing``)."""
    reg = _ACTIVE.registry
    if reg is None:
        return contextlib.nullcontext()
    return jax.named_scope(f"{MODULE_SCOPE}{reg.index(path, type_names)}")


def mark_head(logits: Any) -> Any:
    """Names the model's main output: the matmuls it derives from are the output head.

    By default ``with_policy`` finds the head from the first floating output leaf (auxiliary
    outputs and loss terms never move it). A model whose main output is not its first leaf
    (a dict ``{"aux": ..., "logits": ...}``, whose leaves are sorted by key) or whose head
    feeds further computation calls ``mark_head`` on the logits; then only the values so
    marked decide the head. Outside a policied trace it returns ``logits`` unchanged (no
    operation); inside, each array passes through an identity ``copy`` in a named scope the
    analysis reads.

    Example:
      >>> import jax.numpy as jnp
      >>> from fmtkit.policy import mark_head
      >>> mark_head(jnp.ones(2)).tolist()
      [1.0, 1.0]
    """
    if _ACTIVE.registry is None:
        return logits
    with jax.named_scope(HEAD_SCOPE):
        return jax.tree.map(lambda t: jnp.array(t, copy=True), logits)


def _chain(eqn, prefix: tuple[int, ...]) -> tuple[int, ...]:
    found = _scopes(eqn.source_info.name_stack)[0]
    return prefix + found if found else prefix


@functools.lru_cache(maxsize=8192)
def _scopes(name_stack) -> tuple[tuple[int, ...], bool]:
    """(module scope indices, innermost last; whether ``mark_head``'s scope is in it) of an
    equation's name stack. Cached: equal stacks recur (every equation a module writes) and
    hashing one is several times cheaper than printing it."""
    text = str(name_stack)
    return tuple(int(i) for i in _MODULE_RX.findall(text)), HEAD_SCOPE in text


# ---------------------------------------------------------------------------------------------
# Cotangent rounding (a module's grad_dtype).


# Private switch for tests: False wraps a value in one rounding per module it leaves (the
# behaviour before the dedup), to show the dedup leaves gradients bit-identical.
_DEDUP_COTANGENT = True


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def round_cotangent(x: jax.Array, dtype: str) -> jax.Array:
    """Identity on the forward pass; the tangent (so the cotangent) is rounded to ``dtype``.

    JAX ties a cotangent's dtype to its primal's, so ``grad_dtype`` is a rounding
    (``t.astype(dtype).astype(t.dtype)``), not a change of dtype. A custom JVP rather than a
    custom VJP, so ``jax.jvp`` and grad-of-grad work as well.
    """
    return x


@round_cotangent.defjvp
def _round_cotangent_jvp(dtype, primals, tangents):
    (x,), (t,) = primals, tangents
    with jax.named_scope(GRAD_SCOPE + str(dtype)):
        return x, t.astype(dtype).astype(t.dtype)


# ---------------------------------------------------------------------------------------------
# Analysis: projections, the head, delayed-FP8 slots.


@functools.lru_cache(maxsize=256)
def _floating(dtype) -> bool:
    return jnp.issubdtype(dtype, jnp.floating)  # cached: a few dtypes, asked per operand


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
        ins = [_Facts(param=bool(p), const=not _floating(v.aval.dtype),
                      data=_floating(v.aval.dtype) and not p)
               for v, p in zip(jaxpr.invars, param_inputs)]
        outs = self._walk(jaxpr, ins, (), (), ())
        if self.marked:
            heads = frozenset(self._marked)
        else:  # the main output is the first floating output leaf; the rest are auxiliary
            first = next((f for f, h in zip(outs, head_outputs) if h), _NO_FACTS)
            heads = first.head
        heads = {d for d in heads if self.dots[d].projection}
        for d in heads:
            self.dots[d] = dataclasses.replace(self.dots[d], head=True)
            if modules.head_applies(self.dots[d].module):  # the head stays out of FP8
                key = self.sites.pop(d, None)
                if key is not None:
                    self.site_shapes.pop(key)
        self.heads = frozenset(heads)

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
            chain = _chain(eqn, prefix)
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
        if _scopes(eqn.source_info.name_stack)[1]:
            self.marked = True
            self._marked.update(*(a.head for a in args))
        if name in _ops.INLINE_CALLS:
            return self._walk(eqn.params["jaxpr"].jaxpr, args, chain, idp, dims)
        if name == "custom_jvp_call":
            return self._walk(eqn.params["call_jaxpr"].jaxpr, args, chain, idp, dims)
        if name in _ops.REMAT:
            return self._walk(eqn.params["jaxpr"], args, chain, idp, dims)
        if name == "scan" and _scan_counts(eqn) is not None:
            n0, n1, _ = _scan_counts(eqn)
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
            info = DotInfo(module, any(a.param for a in args[:2]), bool(lb))
            self.dots[idp] = info
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
        body = _BODIES.get(name)
        if body is not None:
            outs = getattr(self, body)(eqn, args, chain, idp, dims)
            if outs is not None:
                return outs
        if list(jex.jaxprs_in_params(eqn.params)):  # pallas_call, unknown bodies: opaque
            return [_Facts(dep=dep, const=const, data=data)] * n_out
        heads = frozenset().union(*(a.head for a in args))
        if heads:
            # A value stays on the head's chain when combined with constants, parameters or
            # anything computed from parameters alone (an L2 penalty), values downstream of
            # the same matmul, and, in a sum, scalar terms (an aux loss, a metric).
            term = name in _LOSS_SUMS
            if term and all(a.scalar for a in args):
                # A sum of loss terms: the head comes from the first term that has one (the
                # main loss written first; an aux loss from another projection adds none).
                heads = next((a.head for a in args if a.head), frozenset())
            else:
                heads = frozenset(d for d in heads
                                  if all(a.const or a.param or not a.data or d in a.dep
                                         or (term and a.scalar) for a in args))
        view = name in _ops.VIEW_OPS and bool(args)
        param = view and args[0].param
        # The author's upcast of an activation (``y.astype(jnp.float32)``), seen through views;
        # a parameter upcast by promotion (bf16 weights meeting f32 inputs) is not one.
        upcast = not param and ((view and args[0].upcast) or (
            name == "convert_element_type" and eqn.params["new_dtype"] == _F32
            and _floating(eqn.invars[0].aval.dtype)
            and np.dtype(eqn.invars[0].aval.dtype).itemsize < 4))
        if name == "convert_element_type" and _floating(eqn.invars[0].aval.dtype) \
                and _floating(eqn.params["new_dtype"]):
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
        outs = []
        for v in eqn.outvars:
            floating = _floating(v.aval.dtype)
            scalar = int(np.prod(getattr(v.aval, "shape", ()))) == 1 or (view and args[0].scalar)
            outs.append(_Facts(param=param, const=const, dep=dep,
                               head=heads if floating else frozenset(), upcast=upcast,
                               data=data, scalar=scalar,
                               narrowed=narrowed if floating else None))
        return outs

    # -- bodies of control flow (see ``_BODIES``); each walks what the Interpreter runs ------
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
        (cj, _), (bj, _) = _open(eqn.params["cond_jaxpr"]), _open(eqn.params["body_jaxpr"])
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
        return self._walk(_open(eqn.params["jaxpr"])[0], args, chain, idp, dims)

    def _custom_vjp_facts(self, eqn, args, chain, idp, dims):
        parts = self._modules.vjp_parts(eqn)
        if parts is None:
            return None
        outs = self._walk(parts.fwd, args[parts.num_consts:], chain, idp, dims)
        return outs[parts.num_res:]


# Primitives holding a body that the policy interprets: name -> handler (``Analysis`` method
# ``<handler>_facts``, ``Interpreter`` method ``_<handler>``). ``jit``, ``scan``, ``remat``
# and ``custom_jvp`` are dispatched before (they were first). Any other primitive with a body
# runs as traced, with one warning per module and primitive.
_BODIES = {
    "cond": "_cond_facts", "while": "_while_facts", "shard_map": "_shard_map_facts",
    "custom_vjp_call": "_custom_vjp_facts",
}


def _open(jaxpr) -> tuple[Any, Sequence[Any]]:
    """(open jaxpr, consts) of a Jaxpr or ClosedJaxpr parameter."""
    if isinstance(jaxpr, jex.ClosedJaxpr):
        return jaxpr.jaxpr, jaxpr.consts
    return jaxpr, ()


@functools.lru_cache(maxsize=256)
def _holds_matmul(jaxpr) -> bool:
    """Whether a jaxpr (or any body inside it) has a matmul."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in _ops.MATMUL:
            return True
        if any(_holds_matmul(_open(sub)[0]) for sub in jex.jaxprs_in_params(eqn.params)):
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


def _vjp_parts(eqn) -> VjpParts | None:
    """JAX keeps a custom VJP's forward rule as a thunk that traces it (``fwd_jaxpr_thunk``,
    called as JAX's own ``lift_fwd`` does) and the backward as a flat function of (residuals,
    cotangents) -> (input cotangents, logs): private structure, so None (the primitive then
    runs as traced, with a warning) if it is not what jax 0.11 has."""
    try:
        p = eqn.params
        nc = int(p["num_consts"])
        nonzero = [_floating(v.aval.dtype) for v in eqn.invars[nc:]]
        fwd, consts = p["fwd_jaxpr_thunk"].call_wrapped(*nonzero)
        _, res_tree, forwarded = p["out_trees"]()
        num_res = res_tree.num_leaves - sum(f is not None for f in forwarded)
        if len(fwd.outvars) != num_res + len(eqn.outvars) or len(fwd.invars) != len(nonzero):
            return None
        return VjpParts(fwd, tuple(consts), nc, num_res, tuple(forwarded), p["bwd"])
    except Exception:  # any change of JAX's internals: run as traced (and warn)
        return None


def _scan_counts(eqn) -> tuple[int, int, int] | None:
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


# ---------------------------------------------------------------------------------------------
# Interpretation.


# Private switch for tests and benchmarks: False traces the model on every call even where its
# policied model keeps traces (``_trace_cache``).
_TRACE_CACHE = True

# Private switch for tests and benchmarks: False binds every rebuilt equation directly (the
# behaviour before the per-primitive ``jit``), to show the two give the same program.
_JIT_PRIMITIVES = True
# How those jits are inlined: JAX_EARLY, into the enclosing jaxpr as it is traced (private, so
# a test can show that another mode changes the program).
_JIT_INLINE = jax.Inline.JAX_EARLY


def _bind(eqn, invals: Sequence[Any], **overrides) -> list[Any]:
    params = eqn.primitive.get_bind_params(eqn.params)
    if overrides:
        params = {**params, **overrides}
    call = _primitive_call(eqn.primitive, params) if _JIT_PRIMITIVES and not eqn.effects \
        else None
    out = (call(*invals) if call is not None else eqn.primitive.bind(*invals, **params))
    return list(out) if eqn.primitive.multiple_results else [out]


def _primitive_call(primitive, params: dict) -> Callable | None:
    """The primitive as a ``jax.jit(inline=JAX_EARLY)`` function of its operands, shared by
    every equation with the same parameters; None if a parameter is not hashable.

    Why: under the user's ``jax.grad`` a primitive bound by itself is linearized from its
    JVP rule on every bind (a fresh trace and partial evaluation each: about 1 ms on this
    CPU), while a ``jit`` is linearized once per jaxpr and operand types (``jax.jit``'s
    trace cache gives the same jaxpr, JAX's linearization cache keys on it). ``jnp`` binds
    its own operators the same way (``jnp.add`` is such a ``jit``), which is why the
    unwrapped model's trace pays this cost once per operator type, not per call. JAX_EARLY
    inlines the body into the enclosing jaxpr as it is traced: the program is the same."""
    if "subfuns" in params or any(callable(v) or isinstance(v, (jex.Jaxpr, jex.ClosedJaxpr))
                                  for v in params.values()):
        return None  # a body or a rule (custom_jvp_call, an opaque call): bound directly
    try:
        return _jitted_primitive(primitive, tuple(sorted(params.items())))
    except TypeError:  # an unhashable parameter (a list)
        return None


@functools.lru_cache(maxsize=4096)
def _jitted_primitive(primitive, params: tuple) -> Callable:
    kwargs = dict(params)

    def call(*xs):
        return primitive.bind(*xs, **kwargs)

    call.__name__ = primitive.name
    return jax.jit(call, inline=_JIT_INLINE)


@functools.lru_cache(maxsize=64)
def _jitted_cast(dtype: np.dtype) -> Callable:
    """``convert_element_type`` to ``dtype`` as a shared ``jit`` (see ``_primitive_call``)."""
    def cast(x):
        return lax.convert_element_type(x, dtype)

    return jax.jit(cast, inline=_JIT_INLINE)


def _is_float_value(x) -> bool:
    return hasattr(x, "dtype") and _floating(x.dtype)


def _cast(x, dtype):
    if not _is_float_value(x) or not _floating(dtype):
        return x
    dtype = np.dtype(dtype)
    if x.dtype == dtype:
        return x
    return _jitted_cast(dtype)(x) if _JIT_PRIMITIVES else lax.convert_element_type(x, dtype)


def _wider(a, b) -> np.dtype:
    a, b = np.dtype(a), np.dtype(b)
    if a == b:
        return a
    if a.itemsize != b.itemsize:
        return a if a.itemsize > b.itemsize else b
    return _F32  # bf16 vs f16: neither holds the other


def _mixed_matmul(eqn, lhs, rhs, out_dtype):
    """A matmul on narrow operands with a wider result (the head's f32 logits), whose two
    backward GEMMs also run on the narrow dtype (the cotangent is cast down first), as a
    bf16 head matmul does in frameworks that keep f32 logits."""
    narrow = lhs.dtype

    def low(a, b):
        return _bind(eqn, [a, b], preferred_element_type=narrow)[0]

    @jax.custom_vjp
    def matmul(a, b):
        return _bind(eqn, [a, b], preferred_element_type=out_dtype)[0]

    def fwd(a, b):
        return matmul(a, b), (a, b)

    def bwd(res, g):
        _, vjp = jax.vjp(low, *res)
        return vjp(g.astype(narrow))

    matmul.defvjp(fwd, bwd)
    return matmul(lhs, rhs)


class Interpreter:
    """Evaluates a traced jaxpr under ``rules`` (see the module docstring)."""

    def __init__(self, rules: Rules, registry: Registry, *, fp8_state: dict | None = None,
                 record: Recorder | None = None):
        self.rules = rules
        self.registry = registry
        self.fp8_state = fp8_state
        self.record = record
        self._policies: dict[int | None, tuple[Policy | None, bool]] = {}
        self._warned: set[str] = set()
        self._vjp: dict[int, tuple[Any, VjpParts | None]] = {}
        self._before_cast: dict[tuple, np.dtype] = {}  # cast idpath -> dtype of its input
        self._visited: dict[str, tuple[str, ...]] | None = None  # path -> class names
        self.analysis: Analysis | None = None

    # -- rules ----------------------------------------------------------------------------
    def path(self, module: int | None) -> str:
        return "" if module is None else self.registry.modules[module].path

    def resolve(self, module: int | None) -> tuple[Policy | None, bool]:
        """(policy, matched-by-a-pattern) of a module (None: code outside every module)."""
        if module not in self._policies:
            info = (self.registry.modules[module] if module is not None
                    else ModuleInfo("", ()))
            if self._visited is None:
                self._visited = self.registry.visited()
            i = self.rules.match(info.path, info.type_names,
                                 ancestor_types(info.path, self._visited))
            self._policies[module] = ((self.rules.default, False) if i is None
                                      else (self.rules.rules[i][1], True))
        return self._policies[module]

    def policy_of(self, module: int | None) -> Policy | None:
        return self.resolve(module)[0]

    def head_applies(self, module: int | None) -> bool:
        """Whether a head matmul written in ``module`` gets ``Rules.head`` (patterns win)."""
        return self.rules.head is not None and not self.resolve(module)[1]

    def analyze(self, closed, param_inputs: Sequence[bool], head_outputs: Sequence[bool]
                ) -> Analysis:
        self.analysis = Analysis(closed, param_inputs, head_outputs, self)
        return self.analysis

    # -- evaluation -----------------------------------------------------------------------
    def run(self, closed, args: Sequence[Any],
            leave: Sequence[bool | tuple[int, ...]] | None = None) -> list[Any]:
        """Interprets ``closed`` on ``args`` (flat). Per output, ``leave`` (default: all
        True): True, it leaves every module (cast to each one's ``output_dtype``); False,
        it is returned as computed; a scope chain, it is read there (as the module at the
        end of the chain sees it: the outputs of the modules it did not run are cast)."""
        assert self.analysis is not None, "analyze first"
        return self._walk(closed.jaxpr, closed.consts, list(args), [()] * len(args), (), (),
                          self.fp8_state or {}, leave)

    def _walk(self, jaxpr, consts, args, arg_chains, prefix, idprefix, fp8_local,
              leave=None):
        env: dict[Any, Any] = {}
        chains: dict[Any, tuple] = {}
        exits: dict[tuple, Any] = {}
        for v, x, c in zip(jaxpr.invars, args, arg_chains):
            env[v], chains[v] = x, c
        for v, x in zip(jaxpr.constvars, consts):
            env[v], chains[v] = x, ()

        def read(v, consumer: tuple):
            if isinstance(v, jex.Literal):
                return np.asarray(v.val, dtype=v.aval.dtype)
            x, producer = env[v], chains[v]
            common = 0
            for a, b in zip(producer, consumer):
                if a != b:
                    break
                common += 1
            if len(producer) == common or not _is_float_value(x):
                return x
            key = (v, common)
            if key not in exits:
                exits[key] = self._exit(x, producer[common:],
                                        self.analysis.is_head_value(idprefix, v))
            return exits[key]

        for i, eqn in enumerate(jaxpr.eqns):
            chain = _chain(eqn, prefix)
            invals = [read(v, chain) for v in eqn.invars]
            outs = self._eqn(eqn, invals, chain, (*idprefix, i), idprefix, fp8_local)
            for v, x in zip(eqn.outvars, outs):
                env[v], chains[v] = x, chain
        if leave is None:
            return [read(v, prefix) for v in jaxpr.outvars]
        return [read(v, prefix) if e is True or isinstance(v, jex.Literal) else
                env[v] if e is False else read(v, e) for v, e in zip(jaxpr.outvars, leave)]

    def _exit(self, x, modules: tuple[int, ...], head_value: bool):
        """Casts a value leaving ``modules`` (innermost last) to their output dtypes.

        A value leaving nested modules with the same ``grad_dtype`` and no cast in between
        (the same array) is wrapped in one ``round_cotangent``, not one per module: rounding
        to a dtype is idempotent, so the gradients are bit-identical and the trace shorter.
        """
        rounded: tuple[Any, np.dtype] | None = None  # (value, dtype) last wrapped here
        for m in reversed(modules):
            policy, explicit = self.resolve(m)
            path = self.registry.modules[m].path
            root_by_rule = path == "" and not explicit and self.rules.output_dtype is not None
            if policy is not None and not root_by_rule:  # else: Rules.output_dtype decides
                odt = np.dtype(policy.output_dtype)
                if not (head_value and odt.itemsize < x.dtype.itemsize):
                    x = _cast(x, odt)
                gdt = np.dtype(policy.grad_dtype)
                if (gdt != _F32 and gdt != x.dtype
                        and not (_DEDUP_COTANGENT and rounded is not None
                                 and rounded[0] is x and rounded[1] == gdt)):
                    x = round_cotangent(x, policy.grad_dtype)
                    rounded = (x, gdt)
            if self.record is not None:
                self.record.exits.setdefault(path, set()).add(str(x.dtype))
        return x

    def _eqn(self, eqn, invals, chain, idp, idprefix, fp8_local) -> list[Any]:
        name = eqn.primitive.name
        scope = (self._record(eqn, chain, idp) if self.record is not None
                 else contextlib.nullcontext())
        with scope:
            if name in _ops.INLINE_CALLS:
                return self._jit(eqn, invals, chain, idp, fp8_local)
            if name == "custom_jvp_call":
                return self._custom_jvp(eqn, invals, chain, idp, fp8_local)
            if name in _ops.REMAT:
                return self._checkpoint(eqn, invals, chain, idp, fp8_local)
            if name == "scan" and _scan_counts(eqn) is not None:
                return self._scan(eqn, invals, chain, idp, fp8_local)
            body = _BODIES.get(name)
            if body is not None:
                outs = getattr(self, body.removesuffix("_facts"))(eqn, invals, chain, idp,
                                                                  fp8_local)
                if outs is not None:
                    return outs
            if name in _ops.DTYPE_EXACT:  # bit patterns: on the traced dtypes
                return _bind(eqn, [_cast(x, v.aval.dtype) for x, v in zip(invals, eqn.invars)])
            if list(jex.jaxprs_in_params(eqn.params)):
                return self._opaque(eqn, invals, chain)
            policy = self.policy_of(chain[-1] if chain else None)
            if name in _ops.MATMUL and policy is not None:
                return [self._matmul(eqn, invals, chain, idp, idprefix, policy, fp8_local)]
            if name in _ops.F32_OPS and policy is not None:
                return _bind(eqn, [_cast(x, _F32) if _is_float_value(x)
                                   and x.dtype.itemsize < 4 else x for x in invals])
            if name == "convert_element_type":
                return [self._convert(eqn, invals[0], idp, policy)]
            return _bind(eqn, self._follow(eqn, invals, idprefix, policy))

    def _follow(self, eqn, invals, idprefix, policy):
        """Operands that had one dtype in the trace get the widest of their current dtypes.

        Constants written in the model (literals, weakly typed Python scalars) take their
        partners' dtype, and parameters count in the module's compute dtype (a bias added to a
        bf16 matmul result stays bf16, as parameters cast at use would), so only activations
        decide.
        """
        groups: dict[np.dtype, list[int]] = {}
        for j, v in enumerate(eqn.invars):
            if _floating(v.aval.dtype):
                groups.setdefault(np.dtype(v.aval.dtype), []).append(j)
        out = list(invals)
        cdt = None if policy is None else np.dtype(policy.compute_dtype)
        for members in groups.values():
            if len(members) < 2:
                continue
            weak, strong = [], []
            for j in members:
                v = eqn.invars[j]
                if isinstance(v, jex.Literal) or v.aval.weak_type:
                    weak.append(j)
                elif cdt is not None and self.analysis.is_param(idprefix, v):
                    out[j] = _cast(out[j], cdt)
                    weak.append(j)
                else:
                    strong.append(j)
            pick = strong or members
            target = np.dtype(out[pick[0]].dtype)
            for j in pick[1:]:
                target = _wider(target, out[j].dtype)
            for j in members:
                out[j] = _cast(out[j], target)
        return out

    def _convert(self, eqn, x, idp, policy):
        """An author's cast, applied as written; except a round trip's way back
        (``x.astype(bf16)``, a dispatch, ``.astype(f32)``), which restores the dtype the
        value had before its narrowing in this run (bf16 for a bf16 module's activation)."""
        src, dst = np.dtype(eqn.invars[0].aval.dtype), np.dtype(eqn.params["new_dtype"])
        if _is_float_value(x):
            self._before_cast[idp] = x.dtype
        if _floating(src) and src == dst:
            return x  # a weak-type change in the trace: the value follows its input
        narrowing = self.analysis.round_trips.get(idp)
        if (narrowing is not None and policy is not None
                and narrowing in self._before_cast and _is_float_value(x)):
            return _cast(x, self._before_cast[narrowing])
        return _bind(eqn, [x])[0]

    def _matmul(self, eqn, invals, chain, idp, idprefix, policy, fp8_local):
        info = self.analysis.dots.get(idp)
        module = chain[-1] if chain else None
        head = info is not None and info.head and self.head_applies(module)
        if head:
            policy = self.rules.head
        cdt = np.dtype(policy.compute_dtype)
        lhs, rhs = invals[0], invals[1]
        targets = []
        for x, v in zip((lhs, rhs), eqn.invars[:2]):
            keep = (_is_float_value(x) and x.dtype == _F32
                    and self.analysis.is_upcast(idprefix, v))
            targets.append(_F32 if keep else cdt)
        target = _wider(*targets)
        lhs, rhs = _cast(lhs, target), _cast(rhs, target)
        out_dt = np.dtype(policy.output_dtype) if head else target
        recipe = policy.fp8
        if (recipe is not None and not head and target == cdt and info is not None
                and info.projection and eqn.primitive.name == "dot_general"):
            out = self._fp8_matmul(eqn, lhs, rhs, recipe, idp, module, info, fp8_local, cdt)
            if out is not None:
                return out
        if not (_is_float_value(lhs) and _is_float_value(rhs)):
            return _bind(eqn, [lhs, rhs, *invals[2:]])[0]
        if out_dt.itemsize > target.itemsize:
            return _mixed_matmul(eqn, lhs, rhs, out_dt)
        return _bind(eqn, [lhs, rhs, *invals[2:]], preferred_element_type=out_dt)[0]

    def _fp8_matmul(self, eqn, lhs, rhs, recipe, idp, module, info, fp8_local, cdt):
        path = self.path(module)
        kwargs = {}
        if recipe.delayed:
            key = self.analysis.sites.get(idp)
            if key is None or key not in fp8_local:
                reason = ("no amax history was passed for it (initialize the policied model "
                          "and pass its 'fp8_state')")
                self._warn(path, f"FP8 recipe {recipe} skipped for a matmul in module "
                                 f"{path or '<root>'!r}: {reason}; it runs in {cdt.name}.")
                return None
            kwargs["fp8_state"] = DelayedScalingState(fp8_local[key])
        try:
            return fp8.dot_general_fn(recipe)(lhs, rhs, eqn.params["dimension_numbers"], None,
                                              preferred_element_type=cdt, **kwargs)
        except ValueError as err:
            raise ValueError(f"FP8 matmul in module {path or '<root>'!r} (recipe "
                             f"{recipe}): {err}") from None

    def _record(self, eqn, chain, idp):
        module = chain[-1] if chain else None
        info = ModuleInfo("", ()) if module is None else self.registry.modules[module]
        policy = self.policy_of(module)
        dot = self.analysis.dots.get(idp)
        head = bool(dot and dot.head and self.head_applies(module))
        type_name = info.type_names[0] if info.type_names else "-"
        self.record.modules.setdefault(info.path, (type_name, policy))
        facts = [None if isinstance(v, jex.Literal) else self.analysis.facts.get((idp[:-1], v))
                 for v in eqn.invars]
        self.record.ops.append(OpRecord(
            path=info.path, type_name=type_name, policy=self.rules.head if head else policy,
            primitive=eqn.primitive.name, head=head,
            projection=bool(dot and dot.projection),
            param_operands=tuple(j for j, f in enumerate(facts) if f is not None and f.param),
            operand_shapes=tuple(tuple(getattr(v.aval, "shape", ())) for v in eqn.invars)))
        return jax.named_scope(f"{OP_SCOPE}{len(self.record.ops) - 1}")

    def _warn(self, key: str, msg: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(msg, UserWarning, stacklevel=2)

    def _custom_jvp(self, eqn, invals, chain, idp, fp8_local):
        traced = [v.aval.dtype for v in eqn.invars]
        if (all(not _is_float_value(x) or x.dtype == d for x, d in zip(invals, traced))
                and not _holds_matmul(eqn.params["call_jaxpr"].jaxpr)):
            return _bind(eqn, invals)  # dtypes as traced: the original, custom rule and all
        body = eqn.params["call_jaxpr"]

        def original(*xs):
            return _bind(eqn, list(xs))

        @jax.custom_jvp
        def policied(*xs):
            return self._walk(body.jaxpr, body.consts, list(xs), [chain] * len(xs), chain,
                              idp, fp8_local)

        @policied.defjvp
        def policied_jvp(primals, tangents):
            out = policied(*primals)
            p0 = [_cast(p, d) for p, d in zip(primals, traced)]
            t0 = [_cast(t, d) for t, d in zip(tangents, traced)]
            _, t_out = jax.jvp(original, p0, t0)
            return out, [_cast(t, o.dtype) for t, o in zip(t_out, out)]

        return policied(*invals)

    # -- bodies of control flow ------------------------------------------------------------
    def vjp_parts(self, eqn) -> VjpParts | None:
        """``_vjp_parts`` once per equation (the Analysis and the evaluation share it)."""
        key = id(eqn)
        if key not in self._vjp:
            self._vjp[key] = (eqn, _vjp_parts(eqn))  # the eqn is kept so its id stays unique
        return self._vjp[key][1]

    def _opaque(self, eqn, invals, chain):
        """A primitive whose body the policy cannot interpret (``pallas_call``, an unknown
        primitive): it runs as traced, inputs cast back, with one warning per module and
        primitive; ``inspect_policy`` lists its matmuls as not policied."""
        name = eqn.primitive.name
        path = self.path(chain[-1] if chain else None)
        self._warn(f"opaque:{path}:{name}",
                   f"Primitive {name!r} in module {path or '<root>'!r} holds a body the policy "
                   "does not interpret: it runs as traced (its matmuls in their traced dtypes, "
                   "no FP8). inspect_policy lists its matmuls as not policied.")
        if self.record is not None:
            self.record.opaque.append((path, name))
        return _bind(eqn, [_cast(x, v.aval.dtype) for x, v in zip(invals, eqn.invars)])

    def _jit(self, eqn, invals, chain, idp, fp8_local):
        """A nested ``jit`` is kept as a ``jit`` of its interpreted body, with the same
        ``in_shardings``/``out_shardings`` (inlining it changed XLA's fusion of the
        gradient: ~1e-7 differences under "fp32"); other call primitives are inlined."""
        inner = eqn.params["jaxpr"]

        def body(*xs):
            return tuple(self._walk(inner.jaxpr, inner.consts, list(xs), [chain] * len(xs),
                                    chain, idp, fp8_local))

        if eqn.primitive.name not in ("pjit", "jit"):
            return list(body(*invals))
        p = eqn.params
        jitted = jax.jit(body, in_shardings=tuple(p["in_shardings"]),
                         out_shardings=tuple(p["out_shardings"]),
                         keep_unused=p["keep_unused"])
        jitted.__name__ = p.get("name", "jit")  # for the jaxpr's readers
        return list(jitted(*invals))

    def _cond(self, eqn, invals, chain, idp, fp8_local):
        """``cond``/``switch``: each branch interpreted; an output gets the widest of the
        dtypes the branches give it (``lax.switch`` needs one type)."""
        ops = invals[1:]
        n = len(ops)

        def branch(b, br):
            def fn(*xs):
                return self._walk(br.jaxpr, br.consts, list(xs), [chain] * n, chain,
                                  (*idp, b), fp8_local)
            return fn

        fns = [branch(b, br) for b, br in enumerate(eqn.params["branches"])]
        record, self.record = self.record, None  # dtypes only: nothing recorded
        try:
            shapes = [jax.eval_shape(fn, *ops) for fn in fns]
        finally:
            self.record = record
        targets = [functools.reduce(_wider, [s[j].dtype for s in shapes])
                   if all(_floating(s[j].dtype) for s in shapes) else None
                   for j in range(len(eqn.outvars))]

        def cast(fn):
            return lambda *xs: [o if t is None else _cast(o, t) for o, t in zip(fn(*xs),
                                                                             targets)]

        return list(lax.switch(invals[0], [cast(fn) for fn in fns], *ops))

    def _while(self, eqn, invals, chain, idp, fp8_local):
        """``while`` (``fori_loop`` with a traced bound): body and condition interpreted, the
        carry kept in its traced dtypes (as ``scan``'s; a loop needs one carry type)."""
        p = eqn.params
        cn, bn = p["cond_nconsts"], p["body_nconsts"]
        (cj, cc), (bj, bc) = _open(p["cond_jaxpr"]), _open(p["body_jaxpr"])
        cconsts, bconsts = invals[:cn], invals[cn:cn + bn]
        dtypes = [v.aval.dtype for v in eqn.invars[cn + bn:]]
        init = [_cast(x, d) for x, d in zip(invals[cn + bn:], dtypes)]

        def cond_fn(carry):
            args = [*cconsts, *carry]
            return self._walk(cj, cc, args, [chain] * len(args), chain, (*idp, 0),
                              fp8_local)[0]

        def body_fn(carry):
            args = [*bconsts, *carry]
            outs = self._walk(bj, bc, args, [chain] * len(args), chain, (*idp, 1), fp8_local)
            return [_cast(o, d) for o, d in zip(outs, dtypes)]

        return list(lax.while_loop(cond_fn, body_fn, init))

    def _shard_map(self, eqn, invals, chain, idp, fp8_local):
        """``shard_map``: the body interpreted, rebuilt with the same mesh, specs and manual
        axes."""
        p = eqn.params
        body, consts = _open(p["jaxpr"])

        def fn(*xs):
            return tuple(self._walk(body, consts, list(xs), [chain] * len(xs), chain, idp,
                                    fp8_local))

        mapped = jax.shard_map(fn, mesh=p["mesh"], in_specs=tuple(p["in_specs"]),
                               out_specs=tuple(p["out_specs"]), check_vma=p["check_vma"],
                               axis_names=set(p["newly_manual_axes"]))
        return list(mapped(*invals))

    def _custom_vjp(self, eqn, invals, chain, idp, fp8_local):
        """A user's ``jax.custom_vjp``: the forward rule interpreted under the policy (it also
        gives the primal outputs); the user's backward rule runs on the residuals and
        cotangents in their traced dtypes, its results cast to the inputs' dtypes."""
        traced_in = [v.aval.dtype for v in eqn.invars]
        if (all(not _is_float_value(x) or x.dtype == d for x, d in zip(invals, traced_in))
                and not _holds_matmul(_open(eqn.params["call_jaxpr"])[0])):
            return _bind(eqn, invals)  # nothing to change: JAX's own primal and rules
        parts = self.vjp_parts(eqn)
        if parts is None:
            return None
        traced_out = [v.aval.dtype for v in eqn.outvars]
        res_dtypes = [v.aval.dtype for v in parts.fwd.outvars[:parts.num_res]]
        consts = invals[:parts.num_consts]
        n = len(invals) - parts.num_consts

        def forward(xs):
            outs = self._walk(parts.fwd, parts.fwd_consts, list(xs), [chain] * n, chain, idp,
                              fp8_local)
            computed = iter(_cast(r, d) for r, d in zip(outs[:parts.num_res], res_dtypes))
            full = [*consts, *xs]
            res = [next(computed) if f is None else _cast(full[f], traced_in[f])
                   for f in parts.forwarded]
            return outs[parts.num_res:], res

        @jax.custom_vjp
        def policied(*xs):
            return forward(xs)[0]

        in_dtypes = [getattr(x, "dtype", None) for x in invals[parts.num_consts:]]

        def fwd(*xs):
            outs, res = forward(xs)
            return outs, res

        def bwd(res, cts):
            cts = [_cast(g, d) for g, d in zip(cts, traced_out)]
            grads, _logs = parts.bwd.call_wrapped(*res, *cts)
            out = []
            for g, d in zip(grads, in_dtypes):
                if d is None or not _floating(d):
                    out.append(None)
                elif not hasattr(g, "dtype"):  # JAX's symbolic zero
                    out.append(jnp.zeros(g.aval.shape, d))
                else:
                    out.append(_cast(g, d))
            return tuple(out)

        policied.defvjp(fwd, bwd)
        return list(policied(*invals[parts.num_consts:]))

    def _checkpoint(self, eqn, invals, chain, idp, fp8_local):
        body = eqn.params["jaxpr"]

        def fn(*xs):
            return self._walk(body, (), list(xs), [chain] * len(xs), chain, idp, fp8_local)

        return jax.checkpoint(fn, prevent_cse=eqn.params["prevent_cse"],
                              policy=eqn.params["policy"])(*invals)

    def _scan(self, eqn, invals, chain, idp, fp8_local):
        n0, n1, _ = _scan_counts(eqn)
        body = eqn.params["jaxpr"]
        consts, init, xs = invals[:n0], invals[n0:n0 + n1], invals[n0 + n1:]
        carry_dtypes = [getattr(x, "dtype", None) for x in init]
        keys = [k for k in self.analysis.scan_sites.get(idp, []) if k in fp8_local]
        n_in = len(invals)

        def step(carry, inp):
            x, hist = inp
            local = {**fp8_local, **dict(zip(keys, hist))}
            outs = self._walk(body.jaxpr, body.consts, [*consts, *carry, *x], [chain] * n_in,
                              chain, idp, local)
            new = [_cast(o, d) if d is not None else o for o, d in zip(outs[:n1], carry_dtypes)]
            return new, outs[n1:]

        carry, ys = lax.scan(step, list(init), (list(xs), [fp8_local[k] for k in keys]),
                             length=int(eqn.params["length"]), reverse=eqn.params["reverse"],
                             unroll=eqn.params["unroll"])
        return [*carry, *ys]


# ---------------------------------------------------------------------------------------------
# Running a function under rules.


def _is_dynamic(x) -> bool:
    """An array input (a ``jax.ShapeDtypeStruct`` too: tracing needs only its shape, e.g.
    ``init_fp8_state`` on ``jax.eval_shape``'d parameters)."""
    return isinstance(x, (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct))


@dataclasses.dataclass
class Traced:
    """One trace of a function: its jaxpr, the modules it called, its array inputs."""

    closed: jex.ClosedJaxpr
    registry: Registry
    dyn: list[Any]
    params: list[bool]  # per array input: is it a parameter?
    out_tree: Any
    out_avals: list[Any]


def trace(fn: Callable, args: tuple, kwargs: dict, *,
          is_param: Callable[[tuple, Any], bool] = lambda path, x: True,
          scopes: Callable | None = None, cache: _trace_cache.TraceCache | None = None,
          cache_key: Any = None, static_types: tuple[type, ...] = ()) -> Traced:
    """Traces ``fn(*args, **kwargs)`` recording module scopes; array leaves are the inputs.

    Args:
      is_param: ``(key path in (args, kwargs), leaf) -> bool``: which inputs are parameters.
      scopes: a context-manager factory entered around the call inside the trace (the NNX
        adapter's class swap); linen's interceptor is installed by its adapter inside ``fn``.
      cache: where to keep the trace per input signature (``_trace_cache``); None: always
        trace. ``cache_key`` identifies ``fn`` in it (``fn`` itself is often a new closure);
        ``static_types``: leaf types the key compares by value (an adapter's placeholders).
    """
    with_path, treedef = jax.tree_util.tree_flatten_with_path((args, kwargs))
    leaves = [x for _, x in with_path]
    dyn_idx = [i for i, x in enumerate(leaves) if _is_dynamic(x)]
    dyn = [leaves[i] for i in dyn_idx]
    params = [bool(is_param(with_path[i][0], leaves[i])) for i in dyn_idx]
    key = (None if cache is None or not _TRACE_CACHE
           else _trace_cache.signature(leaves, dyn_idx, treedef, static_types))
    if key is not None:
        key = (cache_key, key)
        hit = cache.get(key)
        if hit is not None:
            closed, registry, out_tree, avals = hit
            return Traced(closed, registry, dyn, params, out_tree, avals)
    registry = Registry()

    def flat_fn(*dyn_vals):
        full = list(leaves)
        for i, x in zip(dyn_idx, dyn_vals):
            full[i] = x
        a, k = jax.tree.unflatten(treedef, full)
        with tracing(registry), (scopes() if scopes else contextlib.nullcontext()):
            return fn(*a, **k)

    # The model is traced in the caller's promotion mode, except when it holds parameters or
    # inputs below f32 (pure-bf16 storage): Flax's own layers raise under "strict" once given
    # bf16 (LayerNorm's promote_types(dtype, float32), attention's f32 scale), so that trace
    # runs under "standard", as the model would without a policy.
    narrow = any(_floating(x.dtype) and np.dtype(x.dtype).itemsize < 4 for x in dyn)
    mode = "standard" if narrow else jax.config.jax_numpy_dtype_promotion
    with jax.numpy_dtype_promotion(mode):
        closed, out_shape = jax.make_jaxpr(flat_fn, return_shape=True)(*dyn)
    avals, out_tree = jax.tree.flatten(out_shape)
    # A constant that is a tracer (the model closed over a value of an enclosing trace)
    # exists in that trace only: such a jaxpr is not kept.
    if key is not None and not any(isinstance(c, jax.core.Tracer) for c in closed.consts):
        cache.put(key, (closed, registry, out_tree, avals))
    return Traced(closed, registry, dyn, params, out_tree, avals)


def fp8_slots(traced: Traced, rules: Rules, main: Sequence[bool | str] | None = None
              ) -> dict[str, tuple[int, ...]]:
    """Shapes of the delayed-FP8 amax histories ``rules`` need for this trace, by slot name
    (``"<module path>:dot<i>"``; shape ``[*layers, *batch, 3, history]``: a leading axis per
    enclosing ``scan`` and per batch dimension of the dot); ``main`` as in ``run``."""
    main = [True] * len(traced.out_avals) if main is None else main
    interp = Interpreter(rules, traced.registry)
    return interp.analyze(traced.closed, traced.params,
                          [m is True and _floating(a.dtype)
                           for m, a in zip(main, traced.out_avals)]).site_shapes


def run(traced: Traced, rules: Rules, *, main: Sequence[bool | str] | None = None,
        fp8_state: dict | None = None, record: Recorder | None = None
        ) -> tuple[Any, Interpreter]:
    """Interprets a trace under ``rules``; returns (output tree, the interpreter).

    ``main``: per output leaf, True for a model output (cast to ``rules.output_dtype``,
    searched for the head), False for state handed back (kept in its traced dtype: BatchNorm
    statistics, RNG state), a module path for a value that module sowed (as that module sees
    it: a sub-module's output reaches it cast to the sub-module's output dtype, as the ops
    it runs read it).
    """
    main = [True] * len(traced.out_avals) if main is None else list(main)
    interp = Interpreter(rules, traced.registry, fp8_state=fp8_state,
                         record=record if record is not None else _ACTIVE.recorder)
    interp.analyze(traced.closed, traced.params,
                   [m is True and _floating(a.dtype) for m, a in zip(main, traced.out_avals)])
    # State is not a module output (no output cast applies); a sown value is read where
    # its module sowed it.
    outs = interp.run(traced.closed, traced.dyn,
                      [traced.registry.chain(m) if isinstance(m, str) else m for m in main])
    odt = rules.output_dtype
    final = []
    for x, aval, is_main in zip(outs, traced.out_avals, main):
        if is_main is True:
            final.append(_cast(x, odt) if odt is not None else x)
        elif isinstance(is_main, str):
            final.append(x)
        else:
            final.append(_cast(x, aval.dtype))
    return jax.tree.unflatten(traced.out_tree, final), interp
