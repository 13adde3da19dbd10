"""Every cache of the policy engine, in one module.

* ``TraceCache``: the model's traced jaxpr per input signature (``signature``), as ``jax.jit``
  keeps its traces; each policied model holds one (NNX models share ``NNX_TRACES``).
* ``EagerCache``: an eager policied call compiled once per input signature; each policied
  model holds one (NNX models share ``NNX_EAGER_CALLS``).
* ``jitted_primitive`` / ``jitted_cast``: the shared ``jit`` each rebuilt equation and each
  cast is bound through (``binding``).
* ``holds_matmul``: whether a body has a matmul, per jaxpr (custom rules ask it per call).
* ``PerCall``: what one interpretation traces once per equation (a custom rule's jaxpr, a
  ``custom_vjp`` taken apart), kept for the call only.

(The plans resolved per rules and modules are kept by ``fmtkit.policy._plan``.)

**Traces.** A policied call traces the model (``jax.make_jaxpr``: the model's Python runs)
and then re-interprets the jaxpr under the rules. The jaxpr depends only on the model and
the call's signature, not on the policy, so a second trace of the same model with the same
signature (a train step and an eval step, a fresh ``jax.jit`` of the same step) reuses it
and pays only the interpretation. The key, like ``jax.jit``'s cache key:

* what the adapter says identifies the model: linen, the policied model's own cache (its
  ``inner`` module, compared by value as linen compares modules, the method and ``mutable``);
  NNX, the graphdef (structure, classes, static attributes) and the method; a function, the
  function object;
* the pytree structure of the arguments, the avals of the array leaves (shape, dtype, weak
  type, sharding: ``jax.typeof``) and the values of the other leaves (plain Python values
  only, compared with their types);
* the JAX settings a trace reads (dtype promotion, x64, default matmul precision).

Not cached: a jaxpr whose constants hold a tracer (the model closed over a value traced by
an enclosing transform: it exists in that trace only), and a call with a leaf that is neither
an array nor a plain Python value (an object whose state could change without changing its
hash). The caveat is ``jax.jit``'s: a model whose Python reads something outside its
arguments and attributes (a global, a mutable object it closes over) is not re-traced when
that changes, and Python side effects of the model (a print, a counter) happen on the first
trace only. ``with_policy(..., cache_traces=False)`` turns the cache off.

**Eager calls.** A policied call traces the model and re-interprets the jaxpr under the
rules. Under a JAX transform (``jax.jit``, ``jax.grad``) that happens once per trace of the
user's function; called eagerly (an un-jitted ``apply``) it would happen on every call, and
the interpreted ops would then dispatch one by one. ``EagerCache`` instead compiles the
policied call with ``jax.jit`` once per signature: the pytree structure, the shapes, dtypes
and weak types of the array leaves (jit's own cache key), and the values of the other leaves
(Python scalars, strings, ``train=True`` flags: static, as they were in the trace). So a
second eager call with the same signature neither re-traces the model nor re-interprets it,
and computes what ``jax.jit`` of the same call computes.

A call whose leaves include a tracer (inside the user's transform) or a non-hashable
static leaf, or made under ``intercept_gemms``, is not cached: the caller runs it as before.
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.extend.core as jex
import numpy as np
from jax import lax

from fmtkit.policy import _ops
from fmtkit.policy._engine.jaxprs import open_jaxpr
from fmtkit.policy._gemm_hook import active_hook

# Signatures kept per policied model: a model is called with a few shapes (train and eval
# batches); the oldest signature is dropped beyond this, so a call per new shape cannot
# grow memory without bound.
EAGER_SIGNATURES = 16


# Static leaves a cached call may hold, compared by value: plain Python values. Any other
# object (a module, an object holding arrays) could change between calls without changing
# its hash, and would be baked into the compiled call, so such calls are not cached.
STATIC_TYPES = (bool, int, float, complex, str, bytes, type(None), np.dtype)


def _is_dynamic(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic))


class EagerCache:
    """Per-signature ``jax.jit`` of a policied call, for calls outside any JAX transform."""

    def __init__(self) -> None:
        self._fns: collections.OrderedDict[Any, tuple[Callable, dict]] = collections.OrderedDict()

    def __reduce__(self):
        # Copies and pickles of a policied model start with an empty cache (compiled
        # functions are neither copyable nor picklable).
        return (EagerCache, ())

    def __call__(self, fn: Callable[[Any], Any], tree: Any, static: Any = (),
                 static_types: tuple[type, ...] = (), aux: bool = False) -> tuple[bool, Any]:
        """``(True, fn(tree))`` computed by the cached jit of ``fn`` for this signature, or
        ``(False, None)`` when the call cannot be cached (a tracer among the leaves, or a
        leaf that is neither an array nor a plain Python value nor of ``static_types``);
        ``static`` is extra hashable state of the call (``method``) that ``fn`` closes over
        (it is part of the key). ``aux=True``: ``fn`` returns ``(arrays, python_data)``;
        the data (recorded when the call was traced) is returned with the arrays."""
        if active_hook() is not None:
            return False, None  # intercept_gemms: the hook acts on this call's trace
        leaves, treedef = jax.tree.flatten(tree)
        allowed = STATIC_TYPES + tuple(static_types)
        if not all((_is_dynamic(x) and not isinstance(x, jax.core.Tracer))
                   or isinstance(x, allowed) for x in leaves):
            return False, None
        dyn_idx = tuple(i for i, x in enumerate(leaves) if _is_dynamic(x))
        dyn_set = set(dyn_idx)
        template = [None if i in dyn_set else x for i, x in enumerate(leaves)]
        # The type is part of the key: True == 1 == 1.0 hash alike, but trace differently.
        key = (static, treedef, dyn_idx,
               tuple((type(x), x) for i, x in enumerate(leaves) if i not in dyn_set))
        try:
            hash(key)
        except TypeError:
            return False, None
        entry = self._fns.get(key)
        if entry is None:  # two threads racing here compile twice; both results are right
            recorded: dict[str, Any] = {}

            def flat(*dyn):
                full = list(template)
                for i, x in zip(dyn_idx, dyn):
                    full[i] = x
                out = fn(jax.tree.unflatten(treedef, full))
                if aux:
                    out, recorded["aux"] = out
                return out

            entry = self._fns[key] = (jax.jit(flat), recorded)
            while len(self._fns) > EAGER_SIGNATURES:
                self._fns.popitem(last=False)
        else:
            self._fns.move_to_end(key)
        jitted, recorded = entry
        out = jitted(*(leaves[i] for i in dyn_idx))
        return True, ((out, recorded["aux"]) if aux else out)

    def __len__(self) -> int:
        return len(self._fns)


# Signatures kept per policied model: a model is traced with a few shapes (train and eval
# batches, the last partial batch); beyond this the oldest is dropped, so memory stays bounded.
TRACE_SIGNATURES = 16


def _aval(x: Any) -> Any:
    return jax.typeof(x)  # shape, dtype, weak type, sharding (arrays, tracers, shape structs)


def signature(leaves: list[Any], dyn_idx: list[int], treedef: Any,
              static_types: tuple[type, ...] = ()) -> tuple | None:
    """The cache key of a call's flattened arguments, or None if they cannot be keyed
    (``static_types``: more leaf types compared by value, an adapter's placeholders)."""
    dyn = set(dyn_idx)
    allowed = STATIC_TYPES + tuple(static_types)
    static = []
    for i, x in enumerate(leaves):
        if i in dyn:
            continue
        if not isinstance(x, allowed):
            return None
        static.append((type(x), x))  # True == 1 == 1.0 hash alike but trace differently
    cfg = jax.config
    key = (treedef, tuple(dyn_idx), tuple(static), tuple(_aval(leaves[i]) for i in dyn_idx),
           (cfg.jax_numpy_dtype_promotion, cfg.jax_enable_x64,
            str(cfg.jax_default_matmul_precision)))
    try:
        hash(key)
    except TypeError:
        return None
    return key


class TraceCache:
    """``key -> what one trace recorded`` (jaxpr, module registry, output structure)."""

    def __init__(self, maxsize: int = TRACE_SIGNATURES) -> None:
        self.maxsize = maxsize
        self._entries: collections.OrderedDict[Any, Any] = collections.OrderedDict()

    def __reduce__(self):
        # Copies and pickles of a policied model start empty (jaxprs are not picklable).
        return (TraceCache, (self.maxsize,))

    def get(self, key: Any) -> Any:
        try:
            entry = self._entries[key]
        except (KeyError, TypeError):  # TypeError: a key part whose hash raises
            return None
        self._entries.move_to_end(key)
        return entry

    def put(self, key: Any, entry: Any) -> None:
        try:
            self._entries[key] = entry
        except TypeError:
            return
        while len(self._entries) > self.maxsize:
            self._entries.popitem(last=False)

    def __len__(self) -> int:
        return len(self._entries)


# Traces and eager calls of policied NNX models, shared by every one of them: keyed by the
# graphdef (the policied root class, the structure and static attributes) and the method, a
# few signatures per model.
NNX_TRACES = TraceCache(maxsize=4 * TRACE_SIGNATURES)
NNX_EAGER_CALLS = EagerCache()


@functools.lru_cache(maxsize=4096)
def jitted_primitive(primitive, params: tuple, inline: jax.Inline) -> Callable:
    """``primitive`` with ``params`` as a ``jax.jit`` of its operands (``binding``)."""
    kwargs = dict(params)

    def call(*xs):
        return primitive.bind(*xs, **kwargs)

    call.__name__ = primitive.name
    return jax.jit(call, inline=inline)


@functools.lru_cache(maxsize=64)
def jitted_cast(dtype: np.dtype, inline: jax.Inline) -> Callable:
    """``convert_element_type`` to ``dtype`` as a shared ``jit`` (``binding``)."""
    def convert(x):
        return lax.convert_element_type(x, dtype)

    return jax.jit(convert, inline=inline)


@functools.lru_cache(maxsize=256)
def holds_matmul(jaxpr) -> bool:
    """Whether a jaxpr (or any body inside it) has a matmul."""
    for eqn in jaxpr.eqns:
        if _ops.is_matmul(eqn.primitive.name):
            return True
        if any(holds_matmul(open_jaxpr(sub)[0]) for sub in jex.jaxprs_in_params(eqn.params)):
            return True
    return False


class PerCall:
    """What one interpretation computes once per equation: ``(kind, equation) -> value``.
    The equation is kept with its value, so its ``id`` stays unique while the entry lives."""

    def __init__(self) -> None:
        self._entries: dict[tuple[str, int], tuple[Any, Any]] = {}

    def get(self, kind: str, eqn: Any, make: Callable[[], Any]) -> Any:
        key = (kind, id(eqn))
        if key not in self._entries:
            self._entries[key] = (eqn, make())
        return self._entries[key][1]

