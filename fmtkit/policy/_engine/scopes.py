"""Module scopes and the registry: which module wrote each equation of a policied trace.

While a policied model is traced, each Flax module call runs in a named scope
``fmtkit_module_<i>`` (linen: an ``nn.intercept_methods`` interceptor; NNX: the traced copy's
classes swapped for subclasses whose methods enter the scope), and a ``Registry`` maps ``i``
to the module's path and class names. JAX keeps the name stack on every equation, inside
``jit``, ``scan`` and ``remat`` bodies too, so the analysis and the interpreter read from it
which modules wrote an equation, innermost last. ``mark_head`` names the model's main output
with a scope of its own; ``recording`` collects what ``inspect_policy`` reports. The state is
per thread (a trace runs on one).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import re
import threading
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from fmtkit._switches import SWITCHES
from fmtkit.policy._policy import Policy

MODULE_SCOPE = "fmtkit_module_"
OP_SCOPE = "fmtkit_op_"
HEAD_SCOPE = "fmtkit_head_output"
# The ops of a policied function called inside another policied model's trace: the inner
# policy decided their dtypes, and the outer one binds them as traced (the inner one wins).
NESTED_SCOPE = "fmtkit_nested_policy"
_MODULE_RX = re.compile(MODULE_SCOPE + r"(\d+)")
_OP_RX = re.compile(OP_SCOPE + r"(\d+)")


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
        # Whether a policied function was called inside this trace (``note_nested_call``).
        self.nested_calls = False

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
    # path -> (class name, Policy, the rule pattern that gave it: None for the default)
    modules: dict[str, tuple[str, Policy | None, str | None]] = dataclasses.field(
        default_factory=dict)
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


def active_recorder() -> Recorder | None:
    """The recorder of the enclosing ``recording`` on this thread, or None."""
    return _ACTIVE.recorder


def is_tracing() -> bool:
    """Whether a policied trace is being recorded on this thread: a policied call made now is
    nested in it (and keeps its own policy)."""
    return SWITCHES.nested_policies and _ACTIVE.registry is not None


def note_nested_call() -> None:
    """Notes in the trace being recorded that a policied function is called inside it: its
    ops carry the op scopes of the ``recording`` active then, so the trace is not reused by
    another recording (``trace.trace``)."""
    if SWITCHES.note_nested_calls and _ACTIVE.registry is not None:
        _ACTIVE.registry.nested_calls = True


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


def scope_chain(eqn, prefix: tuple[int, ...]) -> tuple[int, ...]:
    found = name_stack_scopes(eqn.source_info.name_stack)[0]
    return prefix + found if found else prefix


@functools.lru_cache(maxsize=8192)
def name_stack_scopes(name_stack) -> tuple[tuple[int, ...], bool, bool]:
    """(module scope indices, innermost last; whether ``mark_head``'s scope is in it; whether
    an inner policied function wrote it, ``NESTED_SCOPE``) of an equation's name stack.
    Cached: equal stacks recur (every equation a module writes) and hashing one is several
    times cheaper than printing it."""
    text = str(name_stack)
    return (tuple(int(i) for i in _MODULE_RX.findall(text)), HEAD_SCOPE in text,
            NESTED_SCOPE in text)


def recorded_op(name_stack) -> int | None:
    """The index of the innermost op scope (``fmtkit_op_<i>``) in a name stack, or None: the
    op a nested policied call recorded for an equation it bound."""
    found = _OP_RX.findall(str(name_stack))
    return int(found[-1]) if found else None
