"""Binding rebuilt equations: each through a ``jit`` shared by equal equations.

The interpreter binds every equation of the trace again, on operands of the dtypes the rules
give it (``bind``), and casts values between dtypes (``cast``). Both go through a
``jax.jit`` per primitive and parameters (``_jitted_primitive``, ``_jitted_cast``), kept in
an LRU cache, as ``jnp`` binds its own operators: under ``jax.grad`` a ``jit`` is
linearized once per jaxpr and operand types, a bare bind on every call.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np
from jax import lax

F32 = np.dtype(np.float32)


@functools.lru_cache(maxsize=256)
def floating_dtype(dtype) -> bool:
    """Whether ``dtype`` is a floating dtype (cached: a few dtypes, asked per operand)."""
    return jnp.issubdtype(dtype, jnp.floating)


# Private switch for tests and benchmarks: False binds every rebuilt equation directly (the
# behaviour before the per-primitive ``jit``), to show the two give the same program.
_JIT_PRIMITIVES = True
# How those jits are inlined: JAX_EARLY, into the enclosing jaxpr as it is traced (private, so
# a test can show that another mode changes the program).
_JIT_INLINE = jax.Inline.JAX_EARLY


def bind(eqn, invals: Sequence[Any], **overrides) -> list[Any]:
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
    JVP rule on every bind (a fresh trace and partial evaluation each), while a ``jit`` is
    linearized once per jaxpr and operand types (``jax.jit``'s trace cache gives the same
    jaxpr, JAX's linearization cache keys on it). ``jnp`` binds its own operators the same
    way (``jnp.add`` is such a ``jit``), which is why the unwrapped model's trace pays this
    cost once per operator type, not per call. JAX_EARLY inlines the body into the enclosing
    jaxpr as it is traced: the program is the same."""
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
    def convert(x):
        return lax.convert_element_type(x, dtype)

    return jax.jit(convert, inline=_JIT_INLINE)


def is_float_value(x) -> bool:
    return hasattr(x, "dtype") and floating_dtype(x.dtype)


def cast(x, dtype):
    if not is_float_value(x) or not floating_dtype(dtype):
        return x
    dtype = np.dtype(dtype)
    if x.dtype == dtype:
        return x
    return _jitted_cast(dtype)(x) if _JIT_PRIMITIVES else lax.convert_element_type(x, dtype)


def wider(a, b) -> np.dtype:
    a, b = np.dtype(a), np.dtype(b)
    if a == b:
        return a
    if a.itemsize != b.itemsize:
        return a if a.itemsize > b.itemsize else b
    return F32  # bf16 vs f16: neither holds the other

