"""The model's traced jaxpr, kept per input signature (as ``jax.jit`` keeps its traces).

A policied call traces the model (``jax.make_jaxpr``: the model's Python runs) and then
re-interprets the jaxpr under the rules. The jaxpr depends only on the model and the call's
signature, not on the policy, so a second trace of the same model with the same signature
(a train step and an eval step, a fresh ``jax.jit`` of the same step) reuses it and pays
only the interpretation. The key, like ``jax.jit``'s cache key:

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
"""

from __future__ import annotations

import collections
from typing import Any

import jax

from fmtkit.policy import _eager

# Signatures kept per policied model: a model is traced with a few shapes (train and eval
# batches, the last partial batch); beyond this the oldest is dropped, so memory stays bounded.
MAX_SIGNATURES = 16


def _aval(x: Any) -> Any:
    return jax.typeof(x)  # shape, dtype, weak type, sharding (arrays, tracers, shape structs)


def signature(leaves: list[Any], dyn_idx: list[int], treedef: Any,
              static_types: tuple[type, ...] = ()) -> tuple | None:
    """The cache key of a call's flattened arguments, or None if they cannot be keyed
    (``static_types``: more leaf types compared by value, an adapter's placeholders)."""
    dyn = set(dyn_idx)
    allowed = _eager.STATIC_TYPES + tuple(static_types)
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

    def __init__(self, maxsize: int = MAX_SIGNATURES) -> None:
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
