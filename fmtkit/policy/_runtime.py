"""What happens around one policied module call, shared by the linen and NNX adapters.

    inputs  -> floating leaves cast to compute_dtype
    call    -> under the caller's dtype-promotion mode, or "standard" inside Flax's own layers
    outputs -> floating leaves cast to output_dtype, then an identity whose JVP rounds the
               tangent (so, transposed, the incoming cotangent) through grad_dtype

Parameters are cast by the adapters (linen: ``Module.param`` at use; NNX: the module's own
``nnx.Param`` values for the duration of the call).

Everything here runs at trace time only; nothing is stored between traces except the
inspection recorder, which is active only inside ``inspect_policy``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from fmtkit.policy._policy import Policy, _is_floating, cast_floating

# ---------------------------------------------------------------------------------------------
# Cotangent rounding.


GRAD_SCOPE = "fmtkit_grad_round_"


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def round_cotangent(x: jax.Array, dtype: str) -> jax.Array:
    """Identity on the forward pass; the tangent (and so the cotangent) is rounded to ``dtype``.

    The tangent keeps ``x``'s dtype (JAX requires it): ``t.astype(dtype).astype(t.dtype)``.
    A custom JVP rather than a custom VJP, so ``jax.jvp`` and grad-of-grad work as well.
    """
    return x


@round_cotangent.defjvp
def _round_cotangent_jvp(dtype, primals, tangents):
    (x,), (t,) = primals, tangents
    with jax.named_scope(GRAD_SCOPE + str(dtype)):
        return x, t.astype(dtype).astype(t.dtype)


# f32 holds every bf16 and f16 value, so rounding through f32 is the identity.
def _needs_rounding(output_dtype: np.dtype, grad_dtype: str) -> bool:
    return grad_dtype != "float32" and np.dtype(grad_dtype) != output_dtype


def finish_outputs(out: Any, policy: Policy, is_leaf: Callable | None = None) -> Any:
    """Casts floating outputs to ``output_dtype`` and rounds their cotangents via ``grad_dtype``."""
    odt = np.dtype(policy.output_dtype)

    def leaf(x):
        if not _is_floating(x):
            return x
        if x.dtype != odt:
            x = x.astype(odt)
        if _needs_rounding(x.dtype, policy.grad_dtype):
            x = round_cotangent(x, policy.grad_dtype)
        return x

    return jax.tree.map(leaf, out, is_leaf=is_leaf)


# ---------------------------------------------------------------------------------------------
# Per-thread trace state: the caller's promotion mode and the inspection recorder.


class _State(threading.local):
    def __init__(self):
        self.depth = 0
        self.user_promotion = "standard"
        self.recorder: Recorder | None = None


_STATE = _State()


@dataclasses.dataclass
class ModuleRecord:
    path: str
    type_name: str
    policy: Policy | None
    input_dtypes: set = dataclasses.field(default_factory=set)
    output_dtypes: set = dataclasses.field(default_factory=set)


class Recorder:
    """Collects, during one trace, the modules called and a scope name for each."""

    def __init__(self):
        self.records: list[ModuleRecord] = []
        self._index: dict[str, int] = {}

    def enter(self, path: str, type_name: str, policy: Policy | None) -> int:
        if path not in self._index:
            self._index[path] = len(self.records)
            self.records.append(ModuleRecord(path, type_name, policy))
        return self._index[path]


SCOPE_PREFIX = "fmtkit_module_"


@contextlib.contextmanager
def recording():
    """Records module calls (and names their jaxpr scopes) for ``inspect_policy``."""
    prev = _STATE.recorder
    rec = Recorder()
    _STATE.recorder = rec
    try:
        yield rec
    finally:
        _STATE.recorder = prev


def _floating_dtypes(tree: Any, is_leaf) -> set:
    return {str(x.dtype) for x in jax.tree.leaves(tree, is_leaf=is_leaf) if _is_floating(x)}


def is_flax_defined(cls: type, method_name: str) -> bool:
    """Whether ``method_name`` of ``cls`` comes from Flax's own layers (flax.linen / flax.nnx)."""
    for klass in cls.__mro__:
        if method_name in vars(klass):
            return klass.__module__.startswith("flax.")
    return False


def run_module(fn: Callable, args: tuple, kwargs: dict, *, path: str, type_name: str,
               policy: Policy | None, flax_defined: bool,
               is_leaf: Callable | None = None) -> Any:
    """Calls ``fn(*args, **kwargs)`` as one module call under ``policy`` (None: untouched).

    Flax's own layers are written for standard promotion (e.g. LayerNorm's
    ``jnp.promote_types(dtype, jnp.float32)``, ``jax.nn.dot_product_attention``'s
    ``promote_types(query.dtype, float32)``) and raise under ``jax_numpy_dtype_promotion=
    "strict"`` once given bf16; their calls run under "standard". User modules run under the
    mode that was in force when the outermost policied module was entered, so user code keeps
    strict promotion.
    """
    outermost = _STATE.depth == 0
    if outermost:
        _STATE.user_promotion = jax.config.jax_numpy_dtype_promotion
    mode = "standard" if flax_defined else _STATE.user_promotion
    rec = _STATE.recorder
    _STATE.depth += 1
    try:
        if policy is not None:
            args, kwargs = cast_floating((args, kwargs), policy.compute_dtype, is_leaf)
        with contextlib.ExitStack() as stack:
            if jax.config.jax_numpy_dtype_promotion != mode:
                stack.enter_context(jax.numpy_dtype_promotion(mode))
            if rec is not None:
                idx = rec.enter(path, type_name, policy)
                rec.records[idx].input_dtypes |= _floating_dtypes((args, kwargs), is_leaf)
                stack.enter_context(jax.named_scope(f"{SCOPE_PREFIX}{idx}"))
            out = fn(*args, **kwargs)
            if policy is not None:
                out = finish_outputs(out, policy, is_leaf)
        if rec is not None:
            rec.records[idx].output_dtypes |= _floating_dtypes(out, is_leaf)
        return out
    finally:
        _STATE.depth -= 1
