"""Flax NNX adapter: a policied copy of an ``nnx.Module`` graph that shares its Variables.

``wrap(model, rules)``:

1. ``nnx.clone(model, variables=False)``: new Module objects, the same ``Variable`` objects,
   so training the copy (``nnx.Optimizer``, ``nnx.jit``) updates the original's parameters.
2. Each module of the copy whose class has a ``__call__`` (or public methods of its own, e.g.
   ``Embed.attend``) gets its class swapped for a cached subclass carrying its path and
   Policy. The subclass's methods run the original method with the module's own
   ``nnx.Param`` values cast to ``compute_dtype`` (on a shallow copy, see
   ``_call_with_params_in``), cast inputs/outputs and round cotangents
   (``_runtime.run_module``). The path and Policy are class attributes, so they are static:
   they survive ``nnx.split``/``nnx.merge`` and are part of ``nnx.jit``'s cache key.
3. A ``dtype`` attribute (Flax's "dtype of the computation") is set to ``compute_dtype`` on
   the copy; Params are stored in ``param_dtype`` (cast in place when they differ, which the
   original sees too, since the Variables are shared).

Limitations: ``pickle`` of a graphdef holding the swapped classes fails (they are created at
run time); Params held by container nodes (``nnx.List`` of Params) rather than by the module
that uses them are cast by no one.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from fmtkit import fp8
from fmtkit.policy import _runtime
from fmtkit.policy._policy import Policy, Rules, _is_floating, report_unmatched


class Fp8State(nnx.Variable):
    """Amax histories of a delayed FP8 matmul (f32[3, history]); never a ``nnx.Param``.

    Differentiate with respect to it too (``nnx.DiffState(0, (nnx.Param, Fp8State))``): its
    "gradient" holds the observed amaxes; record them with ``fmtkit.fp8.update_state`` and
    ``nnx.update`` once per step, and keep it out of the optimizer.
    """


# The history of the module being called, for its delayed FP8 dot_general (set by the
# policied method around the call; a context variable, so nested and threaded calls are safe).
_ACTIVE_FP8_STATE: contextvars.ContextVar = contextvars.ContextVar("fmtkit_fp8_state",
                                                                   default=None)


def _delayed_dot_general(recipe: fp8.FP8Recipe):
    dot = fp8.dot_general(recipe)

    def fp8_dot_general(lhs, rhs, dimension_numbers, precision=None,
                        preferred_element_type=None, **kwargs):
        hist = _ACTIVE_FP8_STATE.get()
        if hist is None:  # pragma: no cover - set by every policied call
            raise ValueError("delayed FP8 dot_general called outside its policied module.")
        return dot(lhs, rhs, dimension_numbers, precision, preferred_element_type,
                   fp8_state=fp8.Fp8DotState(hist), **kwargs)

    return fp8_dot_general


def _set_fp8(module: nnx.Module, recipe: fp8.FP8Recipe) -> None:
    """Routes an NNX Linear/LinearGeneral matmul through ``fmtkit.fp8`` (others: unchanged)."""
    if "dot_general" not in vars(module):
        return
    if recipe.delayed:
        module.fp8_state = Fp8State(fp8.init_state(recipe).amax_history)
        module.dot_general = _delayed_dot_general(recipe)
    else:
        module.dot_general = fp8.dot_general(recipe)

_CLASSES: dict[tuple[type, str, Policy | None], type] = {}
_BASE_NAMES = frozenset(dir(nnx.Module))


def is_wrapped(obj: Any) -> bool:
    return isinstance(obj, nnx.Module) and "_fmtkit_base" in vars(type(obj))


def base_class(cls: type) -> type:
    return vars(cls).get("_fmtkit_base", cls)


def type_names(cls: type) -> tuple[str, ...]:
    cls = base_class(cls)
    return tuple(c.__name__ for c in cls.__mro__
                 if isinstance(c, type) and issubclass(c, nnx.Module) and c is not nnx.Module)


def _is_graph_obj(x) -> bool:
    return isinstance(x, (nnx.Pytree, nnx.Variable))


def _method_names(cls: type) -> tuple[str, ...]:
    """``__call__`` plus public methods defined by user classes or Flax's layers (nnx.nn)."""
    names: list[str] = []
    for klass in cls.__mro__:
        if klass is nnx.Module or not (isinstance(klass, type) and issubclass(klass, nnx.Module)):
            break
        public_ok = (not klass.__module__.startswith("flax.")
                     or klass.__module__.startswith("flax.nnx.nn."))
        for name, value in vars(klass).items():
            if name in names or not inspect.isfunction(value):
                continue
            if name == "__call__" or (public_ok and not name.startswith("_")
                                      and name not in _BASE_NAMES):
                names.append(name)
    return tuple(names)


_MISSING = object()


def _call_with_params_in(module: nnx.Module, fn, dtype: str, args, kwargs):
    """Runs ``fn(module, ...)`` seeing the module's own Params cast to ``dtype``.

    The Variables are not mutated (that fails when the model is closed over by a JAX
    transform, and would write a cast value into a ``jax.Ref``): the method runs on a shallow
    copy of the module whose Param attributes are new Params (``Variable.copy``) holding the
    cast values; the gradient flows through the cast into the stored value. Attributes the
    method sets on the copy (``sow``, caches) are set on the module afterwards.
    """
    target = jnp.dtype(dtype)
    replaced = {}
    for name, value in vars(module).items():
        if isinstance(value, nnx.Param):
            raw = value.get_value()
            if _is_floating(raw) and raw.dtype != target:
                replaced[name] = value.copy(raw.astype(target))
    if not replaced:
        return fn(module, *args, **kwargs)
    before = dict(vars(module))
    shadow = object.__new__(type(module))
    vars(shadow).update(before)
    vars(shadow).update(replaced)
    out = fn(shadow, *args, **kwargs)
    for name, value in list(vars(shadow).items()):
        if replaced.get(name, _MISSING) is value or before.get(name, _MISSING) is value:
            continue
        setattr(module, name, value)
    return out


def _wrap_method(cls: type, name: str):
    fn = getattr(cls, name)
    flax_defined = _runtime.is_flax_defined(cls, name)
    type_name = cls.__name__

    @functools.wraps(fn)
    def method(self, *args, **kwargs):
        kls = type(self)
        policy: Policy | None = kls._fmtkit_policy

        def call(*a, **k):
            if policy is None:
                return fn(self, *a, **k)
            state = vars(self).get("fp8_state")
            if not isinstance(state, Fp8State):
                return _call_with_params_in(self, fn, policy.compute_dtype, a, k)
            token = _ACTIVE_FP8_STATE.set(state.get_value())
            try:
                return _call_with_params_in(self, fn, policy.compute_dtype, a, k)
            finally:
                _ACTIVE_FP8_STATE.reset(token)

        return _runtime.run_module(call, args, kwargs, path=kls._fmtkit_path,
                                   type_name=type_name, policy=policy,
                                   flax_defined=flax_defined, is_leaf=_is_graph_obj)

    return method


def _policied_class(cls: type, path: str, policy: Policy | None) -> type | None:
    key = (cls, path, policy)
    if key not in _CLASSES:
        names = _method_names(cls)
        if not names:
            _CLASSES[key] = None  # type: ignore[assignment]
        else:
            namespace = {name: _wrap_method(cls, name) for name in names}
            namespace.update(__module__=cls.__module__, __qualname__=cls.__qualname__,
                             __doc__=cls.__doc__, _fmtkit_base=cls, _fmtkit_path=path,
                             _fmtkit_policy=policy)
            _CLASSES[key] = type(cls.__name__, (cls,), namespace)
    return _CLASSES[key]


def collect_paths(model: nnx.Module) -> dict[str, tuple[str, ...]]:
    out = {}
    for parts, module in nnx.iter_modules(model):
        out["/".join(str(p) for p in parts)] = type_names(type(module))
    # iter_modules is post-order (root last); list the root first, then in path order.
    return dict(sorted(out.items(), key=lambda kv: (kv[0] != "", kv[0].split("/"))))


def _store_params(module: nnx.Module, dtype: str) -> None:
    for value in list(vars(module).values()):
        if isinstance(value, nnx.Param):
            raw = value.get_value()
            if _is_floating(raw) and raw.dtype != jnp.dtype(dtype):
                value.set_value(raw.astype(dtype))


def policy_attention(query, key, value, bias=None, mask=None, broadcast_dropout=True,
                     dropout_rng=None, dropout_rate=0.0, deterministic=False, dtype=None,
                     precision=None, module=None, promote_dtype=None, is_causal=False,
                     **kwargs):
    """``nnx.dot_product_attention`` for a compute dtype below f32.

    Where NNX would call ``jax.nn.dot_product_attention`` (no dropout, no sowing module, same
    number of query and key heads), this computes attention as autocast does: QK^T on
    compute-dtype operands with a compute-dtype result, then scale, bias, mask
    (-0.7 * f32 max, as JAX) and softmax in f32, probabilities cast back to the value dtype,
    and PV. Every matmul, forward and backward, then takes compute-dtype operands (JAX's
    ``preferred_element_type=f32`` QK^T has an f32 x bf16 matmul on its backward pass), and
    nothing here hits JAX's function, which raises under strict dtype promotion on the
    backward pass of bf16 inputs even inside a "standard" context. Other cases go to
    ``nnx.dot_product_attention`` unchanged.
    """
    promote = promote_dtype or nnx.nn.dtypes.promote_dtype
    fast = (dropout_rate == 0.0 and module is None and not kwargs
            and key.shape[-2] == query.shape[-2])
    if not fast:
        return nnx.dot_product_attention(
            query, key, value, bias, mask, broadcast_dropout, dropout_rng, dropout_rate,
            deterministic, dtype, precision, module, promote, is_causal, **kwargs)
    query, key, value = promote((query, key, value), dtype=dtype)
    logits = jnp.einsum("...qhd,...khd->...hqk", query, key, precision=precision)
    logits = logits.astype(jnp.float32) * jnp.asarray(1.0 / np.sqrt(query.shape[-1]),
                                                      jnp.float32)
    if bias is not None:
        logits = logits + bias.astype(jnp.float32)
    keep = None if mask is None else mask.astype(jnp.bool_)
    if is_causal:
        t, s = logits.shape[-2:]
        causal = jnp.tril(jnp.ones((t, s), jnp.bool_))
        keep = causal if keep is None else jnp.logical_and(keep, causal)
    if keep is not None:
        big_neg = jnp.asarray(-0.7 * np.finfo(np.float32).max, jnp.float32)
        logits = jnp.where(keep, logits, big_neg)
    probs = jax.nn.softmax(logits, axis=-1).astype(value.dtype)
    return jnp.einsum("...hqk,...khd->...qhd", probs, value, precision=precision)


def wrap(model: nnx.Module, rules: Rules, strict: bool) -> nnx.Module:
    """The policied copy of ``model`` (see the module docstring)."""
    if is_wrapped(model):
        raise ValueError("This NNX model already has a policy (with_policy was applied to it); "
                         "apply with_policy once, to the unwrapped model, with all rules.")
    report_unmatched(rules, collect_paths(model), strict)
    copy = nnx.clone(model, variables=False)
    for parts, module in list(nnx.iter_modules(copy)):
        path = "/".join(str(p) for p in parts)
        cls = type(module)
        policy = rules.resolve(path, type_names(cls))
        if policy is not None:
            _store_params(module, policy.param_dtype)
            cdt = jnp.dtype(policy.compute_dtype)
            if "dtype" in vars(module):
                module.dtype = cdt
            if (isinstance(module, nnx.MultiHeadAttention) and cdt != jnp.float32
                    and module.attention_fn is nnx.dot_product_attention):
                module.attention_fn = policy_attention
            if policy.fp8 is not None:
                _set_fp8(module, policy.fp8)
        sub = _policied_class(cls, path, policy)
        if sub is not None:
            module.__class__ = sub
    return copy
