"""What a primitive handler sees: the two walkers (as protocols), the facts of a value, and
the ``Handler`` record.

A primitive that holds a body (``jit``, ``scan``, ``while``, ``cond``, ``remat``,
``shard_map``, ``custom_jvp``, ``custom_vjp``) has one ``Handler`` (``handlers``): its
``facts``, called by the analysis (``analysis.Analysis``) as it walks the trace, and its
``interpret``, called by the interpreter (``interpreter.Interpreter``) as it evaluates the
trace under the rules. Both take the walker as their first argument; the walkers are typed
here by what the handlers use of them (``Analyzer``, ``Walker``), so the handlers import
neither walker. A leaf of the engine but for the jaxpr helpers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from fmtkit.policy._engine.jaxprs import VjpParts


@dataclasses.dataclass(frozen=True)
class Facts:
    """What the analysis knows of one value of the trace."""

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


class Resolver(Protocol):
    """What the analysis asks of the interpreter it runs for: module paths and policies."""

    def path(self, module: int | None) -> str: ...

    def policy_of(self, module: int | None) -> Any: ...

    def head_applies(self, module: int | None) -> bool: ...

    def vjp_parts(self, eqn: Any) -> VjpParts | None: ...


class Analyzer(Protocol):
    """The analysis, as the handlers' ``facts`` use it."""

    sites: dict[tuple, str]  # idpath of a delayed-FP8 matmul -> slot name
    site_shapes: dict[str, tuple[int, ...]]
    scan_sites: dict[tuple, list[str]]  # idpath of a scan -> slots inside
    counts: dict[str, int]  # slots made per module path
    fwd_rule: int  # depth of custom_vjp forward rules being walked

    def walk(self, jaxpr: Any, ins: list[Facts], prefix: tuple, idprefix: tuple,
             dims: tuple[int, ...]) -> list[Facts]: ...

    def vjp_parts(self, eqn: Any) -> VjpParts | None: ...


class Walker(Protocol):
    """The interpreter, as the handlers' ``interpret`` use it."""

    record: Any  # the Recorder of inspect_policy, or None
    analysis: Any  # the Analysis of the trace being interpreted
    loop_depth: int  # depth of scan/while bodies being interpreted
    loops: list[tuple[Any, int | None]]  # (iteration index, trip count), outermost first
    fwd_rule: int  # depth of custom_vjp forward rules being evaluated
    jvp_body: int  # depth of custom_jvp primal bodies being evaluated
    per_call: Any  # caches.PerCall: rules traced once per equation

    def walk(self, jaxpr: Any, consts: Sequence[Any], args: list[Any],
             arg_chains: list[tuple], prefix: tuple, idprefix: tuple,
             fp8_local: dict) -> list[Any]: ...

    def path(self, module: int | None) -> str: ...

    def warn(self, key: str, msg: str) -> None: ...

    def remat_policy(self, policy: Any) -> Any: ...

    def vjp_parts(self, eqn: Any) -> VjpParts | None: ...


FactsRule = Callable[..., "list[Facts] | None"]
"""``(analyzer, eqn, args: list[Facts], chain, idpath, dims) -> facts of the outputs``, or
None: the equation is then taken as any other primitive with a body (opaque)."""
InterpretRule = Callable[..., "list[Any] | None"]
"""``(walker, eqn, invals, chain, idpath, fp8_local) -> output values``, or None: the
equation then runs as traced (opaque, with a warning)."""


@dataclasses.dataclass(frozen=True)
class Handler:
    """One primitive with a body: both halves of its treatment."""

    facts: FactsRule
    interpret: InterpretRule
