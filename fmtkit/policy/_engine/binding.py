"""Binding rebuilt equations: each through a ``jit`` shared by equal equations.

The interpreter binds every equation of the trace again, on operands of the dtypes the rules
give it (``bind``), and casts values between dtypes (``cast``). Both go through a
``jax.jit`` per primitive and parameters (``caches.jitted_primitive``, ``caches.jitted_cast``),
as ``jnp`` binds its own operators: under ``jax.grad`` a ``jit`` is linearized once per
jaxpr and operand types, a bare bind on every call. (``SWITCHES.jit_primitives`` off binds
directly, ``SWITCHES.jit_inline`` says how the jits are inlined.)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax.extend.core as jex
import numpy as np
from jax import lax

from fmtkit._switches import SWITCHES
from fmtkit.policy._engine import caches
from fmtkit.policy._engine.jaxprs import F32, floating_dtype

__all__ = ["F32", "bind", "cast", "floating_dtype", "is_float_value", "wider"]


def bind(eqn, invals: Sequence[Any], **overrides) -> list[Any]:
    params = eqn.primitive.get_bind_params(eqn.params)
    if overrides:
        params = {**params, **overrides}
    call = (_primitive_call(eqn.primitive, params)
            if SWITCHES.jit_primitives and not eqn.effects else None)
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
        return caches.jitted_primitive(primitive, tuple(sorted(params.items())),
                                       SWITCHES.jit_inline)
    except TypeError:  # an unhashable parameter (a list)
        return None


def is_float_value(x) -> bool:
    return hasattr(x, "dtype") and floating_dtype(x.dtype)


def cast(x, dtype):
    if not is_float_value(x) or not floating_dtype(dtype):
        return x
    dtype = np.dtype(dtype)
    if x.dtype == dtype:
        return x
    if not SWITCHES.jit_primitives:
        return lax.convert_element_type(x, dtype)
    return caches.jitted_cast(dtype, SWITCHES.jit_inline)(x)


def wider(a, b) -> np.dtype:
    a, b = np.dtype(a), np.dtype(b)
    if a == b:
        return a
    if a.itemsize != b.itemsize:
        return a if a.itemsize > b.itemsize else b
    return F32  # bf16 vs f16: neither holds the other
