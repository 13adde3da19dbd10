"""The interpreter: every equation of a trace bound again with the dtypes the rules give it.

``Interpreter`` walks a traced jaxpr under the rules (op classes in ``_ops``): matmuls
on the compute dtype or the FP8 recipe (``matmul.Matmuls``, one per interpreted call),
precision-sensitive ops in f32, the rest following their inputs; module outputs are cast
to the module's ``output_dtype`` and their cotangents rounded through ``grad_dtype``
(``cotangent``). The interpretation is ordinary JAX code, so
``jit``, ``grad`` and ``vmap`` around it work and the backward pass is JAX's own transpose
of the policied forward pass. Every primitive that holds a body is interpreted and rebuilt
by its handler (``handlers.TABLE``: ``jit``, ``scan``, ``remat``, ``cond``/``switch``,
``while``, ``shard_map``, ``custom_jvp``, ``custom_vjp``), which the interpreter passes
itself to. Any other body (``pallas_call``, a primitive this package does not know) runs as
traced, inputs cast back, with one warning per module and primitive. The ops of a policied
function called inside the trace (``scopes.NESTED_SCOPE``) are bound as traced: the inner
policy wins. Equations are bound through ``binding``'s shared jits.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Sequence
from typing import Any

import jax
import jax.extend.core as jex
import numpy as np

from fmtkit._switches import SWITCHES
from fmtkit.policy import _ops
from fmtkit.policy._engine import caches, jaxprs
from fmtkit.policy._engine.analysis import Analysis
from fmtkit.policy._engine.binding import F32, bind, cast, floating_dtype, is_float_value, wider
from fmtkit.policy._engine.cotangent import round_on_exit
from fmtkit.policy._engine.handlers import TABLE
from fmtkit.policy._engine.jaxprs import VjpParts, has_body
from fmtkit.policy._engine.matmul import Matmuls
from fmtkit.policy._engine.scopes import (
    OP_SCOPE,
    ModuleInfo,
    OpRecord,
    Recorder,
    Registry,
    name_stack_scopes,
    recorded_op,
    scope_chain,
)
from fmtkit.policy._plan import Plan
from fmtkit.policy._policy import Policy, is_identity


class Interpreter:
    """Evaluates a traced jaxpr under a plan's rules (see the module docstring)."""

    def __init__(self, plan: Plan, registry: Registry, *, fp8_state: dict | None = None,
                 record: Recorder | None = None, nested: bool = False,
                 warn_no_projection: bool = True):
        self.plan = plan
        # A policied function called inside another policied model's trace: its ops are
        # recorded, its modules reported under the enclosing model's.
        self.nested = nested
        self.rules = plan.rules
        self.registry = registry
        self.fp8_state = fp8_state
        self.record = record
        self._policies: dict[int | None, tuple[Policy | None, bool]] = {}
        self._warned: set[str] = set()
        self._before_cast: dict[tuple, np.dtype] = {}  # cast idpath -> dtype of its input
        self.fwd_rule = 0  # depth of custom_vjp forward rules being evaluated
        self.jvp_body = 0  # depth of custom_jvp primal bodies being evaluated
        # Custom rules traced and custom_vjp calls taken apart, once per equation.
        self.per_call = caches.PerCall()
        self.analysis: Analysis | None = None
        self.loop_depth = 0  # depth of scan/while bodies being interpreted
        # (iteration index, trip count) of the loop bodies being interpreted, outermost first
        # (None, None for a while loop); indices only while a hook is active.
        self.loops: list[tuple[Any, int | None]] = []
        # Rules that change nothing ("fp32"): every op as traced, no exit casts.
        self.identity = SWITCHES.fp32_identity and is_identity(plan.rules)
        self.matmuls = Matmuls(self, warn_no_projection)

    # -- rules ----------------------------------------------------------------------------
    def path(self, module: int | None) -> str:
        return "" if module is None else self.registry.modules[module].path

    def resolve(self, module: int | None) -> tuple[Policy | None, bool]:
        """(policy, matched-by-a-pattern) of a module (None: code outside every module), as
        the plan resolved it."""
        if module not in self._policies:
            info = (self.registry.modules[module] if module is not None
                    else ModuleInfo("", ()))
            self._policies[module] = self.plan.resolve(info.path, info.type_names)
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

    def vjp_parts(self, eqn) -> VjpParts | None:
        """``jaxprs.vjp_parts`` once per equation (the analysis and the evaluation share it)."""
        return self.per_call.get("vjp", eqn, lambda: jaxprs.vjp_parts(eqn))

    def opaque(self, eqn, invals, chain):
        """A primitive whose body the policy cannot interpret (``pallas_call``, an unknown
        primitive): it runs as traced, inputs cast back, with one warning per module and
        primitive; ``inspect_policy`` lists its matmuls as not policied."""
        name = eqn.primitive.name
        path = self.path(chain[-1] if chain else None)
        self.warn(f"opaque:{path}:{name}",
                  f"Primitive {name!r} in module {path or '<root>'!r} holds a body the policy "
                  "does not interpret: it runs as traced (its matmuls in their traced dtypes, "
                  "no FP8). inspect_policy lists its matmuls as not policied.")
        if self.record is not None:
            self.record.opaque.append((path, name))
        return bind(eqn, [cast(x, v.aval.dtype) for x, v in zip(invals, eqn.invars)])

    # -- evaluation -----------------------------------------------------------------------
    def run(self, closed, args: Sequence[Any],
            leave: Sequence[bool | tuple[int, ...]] | None = None) -> list[Any]:
        """Interprets ``closed`` on ``args`` (flat). Per output, ``leave`` (default: all
        True): True, it leaves every module (cast to each one's ``output_dtype``); False,
        it is returned as computed; a scope chain, it is read there (as the module at the
        end of the chain sees it: the outputs of the modules it did not run are cast)."""
        assert self.analysis is not None, "analyze first"
        out = self.walk(closed.jaxpr, closed.consts, list(args), [()] * len(args), (), (),
                         self.fp8_state or {}, leave)
        self.matmuls.ran = True
        self.matmuls.warn_convs()
        self.matmuls.warn_no_projection()
        return out

    def walk(self, jaxpr, consts, args, arg_chains, prefix, idprefix, fp8_local,
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
            if len(producer) == common or not is_float_value(x):
                return x
            key = (v, common)
            if key not in exits:
                exits[key] = self._exit(x, producer[common:],
                                        self.analysis.is_head_value(idprefix, v))
            return exits[key]

        for i, eqn in enumerate(jaxpr.eqns):
            chain = scope_chain(eqn, prefix)
            mesh = _traced_mesh(eqn) if SWITCHES.rebind_traced_mesh else None
            with (jax.sharding.use_abstract_mesh(mesh) if mesh is not None
                  else contextlib.nullcontext()):
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

        Its cotangent is rounded through each module's ``grad_dtype`` (``round_on_exit``: once
        for nested modules with the same one).
        """
        rounded: tuple[Any, np.dtype] | None = None  # (value, dtype) last wrapped here
        for m in reversed(modules):
            policy, explicit = self.resolve(m)
            path = self.registry.modules[m].path
            root_by_rule = path == "" and not explicit and self.rules.output_dtype is not None
            if policy is not None and not root_by_rule and not self.identity:
                # (else: Rules.output_dtype decides, or nothing changes)
                odt = np.dtype(policy.output_dtype)
                if not (head_value and odt.itemsize < x.dtype.itemsize):
                    x = cast(x, odt)
                x, rounded = round_on_exit(x, policy.grad_dtype, rounded)
            if self.record is not None:
                self.record.exits.setdefault(path, set()).add(str(x.dtype))
        return x

    def _eqn(self, eqn, invals, chain, idp, idprefix, fp8_local) -> list[Any]:
        name = eqn.primitive.name
        if name_stack_scopes(eqn.source_info.name_stack)[2]:
            # An inner policied function's op (NESTED_SCOPE): its policy decided it, and it
            # is read (inspect_policy) as the op that call recorded.
            inner = recorded_op(eqn.source_info.name_stack) if self.record is not None else None
            scope = (jax.named_scope(f"{OP_SCOPE}{inner}") if inner is not None
                     else self._record(eqn, chain, idp) if self.record is not None
                     else contextlib.nullcontext())
            with scope:
                return bind(eqn, [cast(x, v.aval.dtype) for x, v in zip(invals, eqn.invars)])
        scope = (self._record(eqn, chain, idp) if self.record is not None
                 else contextlib.nullcontext())
        with scope:
            handler = TABLE.get(name)
            if handler is not None:
                outs = handler.interpret(self, eqn, invals, chain, idp, fp8_local)
                if outs is not None:
                    return outs
            if (name in _ops.DTYPE_EXACT or name in _ops.COMBINER_OPS
                    or (SWITCHES.wide_ops_as_traced and name in _ops.WIDE_OPS)
                    or (self.identity and not has_body(eqn))):
                # bit patterns, FFT, linear algebra, callbacks, every op of "fp32": as traced
                return bind(eqn, [cast(x, v.aval.dtype) for x, v in zip(invals, eqn.invars)])
            if has_body(eqn):
                return self.opaque(eqn, invals, chain)
            policy = self.policy_of(chain[-1] if chain else None)
            if _ops.is_matmul(name) and policy is not None:
                return [self.matmuls.interpret(eqn, invals, chain, idp, idprefix, policy,
                                               fp8_local)]
            if name in _ops.F32_OPS and policy is not None:
                return bind(eqn, [cast(x, F32) if is_float_value(x)
                                   and x.dtype.itemsize < 4 else x for x in invals])
            if name == "convert_element_type":
                return [self._convert(eqn, invals[0], idp, policy)]
            return bind(eqn, self._follow(eqn, invals, idprefix, policy))

    def _follow(self, eqn, invals, idprefix, policy):
        """Operands that had one dtype in the trace get the widest of their current dtypes.

        Constants written in the model (literals, weakly typed Python scalars) take their
        partners' dtype, and parameters count in the module's compute dtype (a bias added to a
        bf16 matmul result stays bf16, as parameters cast at use would), so only activations
        decide.
        """
        groups: dict[np.dtype, list[int]] = {}
        for j, v in enumerate(eqn.invars):
            if floating_dtype(v.aval.dtype):
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
                    out[j] = cast(out[j], cdt)
                    weak.append(j)
                else:
                    strong.append(j)
            pick = strong or members
            target = np.dtype(out[pick[0]].dtype)
            for j in pick[1:]:
                target = wider(target, out[j].dtype)
            for j in members:
                out[j] = cast(out[j], target)
        return out

    def _convert(self, eqn, x, idp, policy):
        """An author's cast, applied as written; except a round trip's way back
        (``x.astype(bf16)``, a dispatch, ``.astype(f32)``), which restores the dtype the
        value had before its narrowing in this run (bf16 for a bf16 module's activation)."""
        src, dst = np.dtype(eqn.invars[0].aval.dtype), np.dtype(eqn.params["new_dtype"])
        if is_float_value(x):
            self._before_cast[idp] = x.dtype
        if floating_dtype(src) and src == dst:
            return x  # a weak-type change in the trace: the value follows its input
        narrowing = self.analysis.round_trips.get(idp)
        if (narrowing is not None and policy is not None
                and narrowing in self._before_cast and is_float_value(x)):
            return cast(x, self._before_cast[narrowing])
        return bind(eqn, [x])[0]

    def remat_policy(self, policy):
        """The user's remat policy as it reads the FP8 GEMMs' outputs
        (``Matmuls.remat_policy``)."""
        return self.matmuls.remat_policy(policy)

    def _record(self, eqn, chain, idp):
        module = chain[-1] if chain else None
        info = ModuleInfo("", ()) if module is None else self.registry.modules[module]
        policy = self.policy_of(module)
        dot = self.analysis.dots.get(idp)
        head = bool(dot and dot.head and self.head_applies(module))
        type_name = info.type_names[0] if info.type_names else "-"
        if not self.nested:
            self.record.modules.setdefault(
                info.path, (type_name, policy, self.plan.rule(info.path, info.type_names)))
        facts = [None if isinstance(v, jex.Literal) else self.analysis.facts.get((idp[:-1], v))
                 for v in eqn.invars]
        self.record.ops.append(OpRecord(
            path=info.path, type_name=type_name, policy=self.rules.head if head else policy,
            primitive=eqn.primitive.name, head=head,
            projection=bool(dot and dot.projection),
            param_operands=tuple(j for j, f in enumerate(facts) if f is not None and f.param),
            operand_shapes=tuple(tuple(getattr(v.aval, "shape", ())) for v in eqn.invars)))
        return jax.named_scope(f"{OP_SCOPE}{len(self.record.ops) - 1}")

    def warn(self, key: str, msg: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(msg, UserWarning, stacklevel=2)


# Primitives that move a value between meshes (``auto_axes``/``explicit_axes`` enter and
# leave their region with them): bound in the enclosing context, as they were traced.
_MESH_MOVES = frozenset({"reshard", "mesh_cast"})


def _traced_mesh(eqn):
    """The abstract mesh an equation was traced under, where it differs from the current
    one (else None): the sharding-in-types mesh of its results' avals.

    ``jax.sharding.auto_axes`` (and ``explicit_axes``) leave no primitive around their
    region: its equations sit inline, their avals on the region's mesh (``Auto`` axes where
    the model's are ``Explicit``), and JAX refuses to bind them under another context mesh.
    They are bound again under theirs.
    """
    if eqn.primitive.name in _MESH_MOVES or not eqn.outvars:
        return None
    mesh = getattr(getattr(eqn.outvars[0].aval, "sharding", None), "mesh", None)
    if mesh is None or getattr(mesh, "empty", True):
        return None
    current = jax.sharding.get_abstract_mesh()
    return None if mesh == current else mesh
