"""Eager calls of a policied model, traced and interpreted once per input signature.

A policied call traces the model and re-interprets the jaxpr under the rules. Under a JAX
transform (``jax.jit``, ``jax.grad``) that happens once per trace of the user's function;
called eagerly (an un-jitted ``apply``) it would happen on every call, and the interpreted
ops would then dispatch one by one. ``EagerCache`` instead compiles the policied call with
``jax.jit`` once per signature: the pytree structure, the shapes, dtypes and weak types of
the array leaves (jit's own cache key), and the values of the other leaves (Python
scalars, strings, ``train=True`` flags: static, as they were in the trace). So a second
eager call with the same signature neither re-traces the model nor re-interprets it, and
computes what ``jax.jit`` of the same call computes.

A call whose leaves include a tracer (inside the user's transform) or a non-hashable
static leaf, or made under ``intercept_gemms``, is not cached: the caller runs it as before.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from fmtkit.policy._gemm_hook import active_hook

# Signatures kept per policied model: a model is called with a few shapes (train and eval
# batches); the oldest signature is dropped beyond this, so a call per new shape cannot
# grow memory without bound.
MAX_SIGNATURES = 16


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
            while len(self._fns) > MAX_SIGNATURES:
                self._fns.popitem(last=False)
        else:
            self._fns.move_to_end(key)
        jitted, recorded = entry
        out = jitted(*(leaves[i] for i in dyn_idx))
        return True, ((out, recorded["aux"]) if aux else out)

    def __len__(self) -> int:
        return len(self._fns)
