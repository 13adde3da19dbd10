"""Tracing a model and running the trace under the rules: how ``with_policy`` works.

How ``with_policy`` works, for a linen model, an NNX model and a plain function alike:

1. **Trace.** The unmodified model runs once under ``jax.make_jaxpr`` in its own dtypes. Each
   Flax module call is wrapped in a named scope ``fmtkit_module_<i>`` (linen:
   ``nn.intercept_methods``; NNX: the traced copy's classes are swapped for subclasses whose
   methods enter the scope), and a ``Registry`` maps ``i`` to the module's path and class
   names (``scopes``). Every equation's name stack then says which modules wrote it,
   innermost last, even inside ``jit``, ``scan`` and ``remat`` bodies. The trace is kept per
   input signature (``caches``), so a second trace of the same call only re-interprets
   it.
2. **Analyze** (``analysis``). One pass over the jaxpr finds, for every matmul, whether it
   is a *projection* (an operand is a view of a parameter: what FP8 recipes target), whether
   it is the model's *output head* (found by its role, not its name), and the delayed-FP8
   amax-history slots it needs.
3. **Interpret** (``interpreter``). Every equation is bound again with the dtypes the rules
   give it (op classes in ``fmtkit.policy._ops``): matmuls on the compute dtype (or the FP8
   recipe), precision-sensitive ops in f32, the rest following their inputs; module outputs
   are cast to the module's ``output_dtype`` and their cotangents rounded through
   ``grad_dtype`` (``cotangent``). Bodies (``jit``, ``scan``, ``cond``, ``custom_vjp``, ...)
   are interpreted and rebuilt, each by its handler (``handlers``). Each rebuilt equation is
   bound through a ``jit`` shared by equal equations (``binding``), as ``jnp`` binds its
   operators: under ``jax.grad`` it is linearized once, not per bind.

This module holds step 1, ``trace``, which a frontend calls first; the frontend then resolves
the rules against the modules the trace called (``fmtkit.policy._plan.resolve_rules``) and hands
the trace and that plan forward to ``runner`` (steps 2 and 3).

Why re-interpretation rather than intercepting ``Primitive.bind`` as the model runs (qwix's
way): changing a dtype while user code still runs breaks its Python-level dtype logic
(``jnp`` promotion raises under ``jax_numpy_dtype_promotion="strict"`` and silently widens
under "standard"; ``lax.scan`` rejects a carry whose dtype changed), and needs no private JAX
API patched. On a finished trace every dtype decision is the policy's.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.extend.core as jex
import numpy as np

from fmtkit._switches import SWITCHES
from fmtkit.policy._engine import caches
from fmtkit.policy._engine.binding import floating_dtype
from fmtkit.policy._engine.scopes import Registry, active_recorder, tracing


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

    @property
    def modules(self) -> dict[str, tuple[str, ...]]:
        """``{path: class names}`` of the modules this trace called, or the root ``""`` alone
        when it called none (a plain function): what a frontend resolves the rules against."""
        return self.registry.visited() or {"": ()}


# The start of the error JAX (0.11) raises for ``jax.set_mesh`` entered inside a trace.
_SET_MESH_IN_TRACE = "`set_mesh` can only be used outside of `jax.jit`"


def trace(fn: Callable, args: tuple, kwargs: dict, *,
          is_param: Callable[[tuple, Any], bool] = lambda path, x: True,
          scopes: Callable | None = None, cache: caches.TraceCache | None = None,
          cache_key: Any = None, static_types: tuple[type, ...] = ()) -> Traced:
    """Traces ``fn(*args, **kwargs)`` recording module scopes; array leaves are the inputs.

    Args:
      is_param: ``(key path in (args, kwargs), leaf) -> bool``: which inputs are parameters.
      scopes: a context-manager factory entered around the call inside the trace (the NNX
        adapter's class swap); linen's interceptor is installed by its adapter inside ``fn``.
      cache: where to keep the trace per input signature (``caches``); None: always
        trace. ``cache_key`` identifies ``fn`` in it (``fn`` itself is often a new closure);
        ``static_types``: leaf types the key compares by value (an adapter's placeholders).
    """
    with_path, treedef = jax.tree_util.tree_flatten_with_path((args, kwargs))
    leaves = [x for _, x in with_path]
    dyn_idx = [i for i, x in enumerate(leaves) if _is_dynamic(x)]
    dyn = [leaves[i] for i in dyn_idx]
    params = [bool(is_param(with_path[i][0], leaves[i])) for i in dyn_idx]
    key = (None if cache is None or not SWITCHES.trace_cache
           else caches.signature(leaves, dyn_idx, treedef, static_types))
    # A trace with policied functions called inside it carries the op scopes of the recording
    # active when it was made (inspect_policy's): another recording traces it again.
    recording = active_recorder() is not None
    if key is not None:
        key = (cache_key, key)
        hit = cache.get(key)
        if hit is not None and not (recording and hit[1].nested_calls):
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
    narrow = any(floating_dtype(x.dtype) and np.dtype(x.dtype).itemsize < 4 for x in dyn)
    mode = "standard" if narrow else jax.config.jax_numpy_dtype_promotion
    with jax.numpy_dtype_promotion(mode):
        try:
            closed, out_shape = jax.make_jaxpr(flat_fn, return_shape=True)(*dyn)
        except ValueError as err:
            if _SET_MESH_IN_TRACE not in str(err):
                raise
            raise ValueError(
                "with_policy traces the model (as jax.jit does), and JAX refuses "
                "jax.set_mesh inside a trace: the model enters a mesh with jax.set_mesh. "
                "Enter it around the call instead (with jax.set_mesh(mesh): "
                "policied(...), jitted or not); inside the model, jax.sharding.auto_axes, "
                "explicit_axes and reshard work under every preset.") from err
    avals, out_tree = jax.tree.flatten(out_shape)
    # A constant that is a tracer (the model closed over a value of an enclosing trace)
    # exists in that trace only: such a jaxpr is not kept.
    if (key is not None and not any(isinstance(c, jax.core.Tracer) for c in closed.consts)
            and not (recording and registry.nested_calls)):
        cache.put(key, (closed, registry, out_tree, avals))
    return Traced(closed, registry, dyn, params, out_tree, avals)
