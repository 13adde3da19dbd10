"""Flax linen adapter: ``PolicyModule`` wraps an unmodified module and applies ``Rules``.

Seams:

* ``nn.share_scope`` in ``setup`` keeps the wrapped model's parameter tree unchanged.
* ``nn.intercept_methods`` is entered inside ``PolicyModule.__call__``, so it is part of every
  trace, including a bare ``jax.jit(wrapped.apply)`` (the interceptor stack is not in the jit
  cache key, so entering it outside the traced function would be unsafe).
* For each intercepted call of a module whose rule gives a Policy, for the duration of the call:
  - the instance's ``param`` method is shadowed: parameters are created in ``param_dtype``
    (the initializer's result is cast) and returned cast to ``compute_dtype``. This reaches
    user modules that call ``self.param`` as well as Flax's layers, compact and setup alike
    (``setup`` is intercepted too);
  - a ``dtype`` dataclass field (Flax's "dtype of the computation") is set to ``compute_dtype``;
  - Flax's ``MultiHeadDotProductAttention`` below f32 computes its softmax in f32, as autocast
    does: QK^T in the compute dtype, logits cast up, softmax, probabilities cast back to the
    compute dtype for PV (``force_fp32_for_softmax`` plus its einsum hooks; without the PV
    hook Flax would run PV as an f32 x bf16 matmul);
  - inputs/outputs are cast and cotangents rounded by ``_runtime.run_module``.
* Lifted-transform wrappers (``nn.scan``/``nn.remat``/``nn.vmap``: method ``'<lambda>'``) pass
  through; their bodies are intercepted as ordinary modules, with paths that have no layer
  index (``blocks/ln_1``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from fmtkit import fp8
from fmtkit.policy import _runtime
from fmtkit.policy._policy import Policy, Rules, cast_floating, report_unmatched

_MISSING = object()


def type_names(cls: type) -> tuple[str, ...]:
    """Class names from ``cls`` up to (excluding) ``nn.Module``, most derived first."""
    return tuple(c.__name__ for c in cls.__mro__
                 if isinstance(c, type) and issubclass(c, nn.Module) and c is not nn.Module)


def module_path(module: nn.Module) -> str:
    return "/".join(str(p) for p in module.path)


@contextlib.contextmanager
def _instance_attrs(module: nn.Module, attrs: dict[str, Any]):
    """Sets instance attributes with ``object.__setattr__``; restores them afterwards."""
    saved = [(k, module.__dict__.get(k, _MISSING)) for k in attrs]
    for k, v in attrs.items():
        object.__setattr__(module, k, v)
    try:
        yield
    finally:
        for k, v in reversed(saved):
            if v is _MISSING:
                object.__delattr__(module, k)
            else:
                object.__setattr__(module, k, v)


def _casting_param(module: nn.Module, policy: Policy):
    original = type(module).param.__get__(module)
    pdt, cdt = policy.param_dtype, policy.compute_dtype

    def param(name, init_fn, *init_args, **init_kwargs):
        def init_in_param_dtype(*args, **kwargs):
            return cast_floating(init_fn(*args, **kwargs), pdt)

        value = original(name, init_in_param_dtype, *init_args, **init_kwargs)
        return cast_floating(value, cdt)

    return param


def _qk_einsum():
    return _einsum


def _pv_einsum_cast():
    return _einsum_probs_to_value_dtype


def _einsum(subscripts, a, b):
    return jnp.einsum(subscripts, a, b)


def _einsum_probs_to_value_dtype(subscripts, probs, value):
    return jnp.einsum(subscripts, probs.astype(value.dtype), value)


class Fp8DelayedDotGeneral(nn.Module):
    """A ``dot_general_cls`` for linen ``Dense``/``DenseGeneral`` under a delayed FP8 recipe.

    Its amax histories live in the ``"fp8_state"`` collection (never in ``"params"``): pass it
    to ``apply`` read-only, differentiate the loss with respect to it as well, and record the
    observed amaxes with ``fmtkit.fp8.update_state(state, grads_of_state)`` once per step.
    """

    recipe: Any

    @nn.compact
    def __call__(self, lhs, rhs, dimension_numbers, precision=None,
                 preferred_element_type=None):
        hist = self.variable("fp8_state", "amax_history",
                             lambda: fp8.init_state(self.recipe).amax_history)
        return fp8.dot_general(self.recipe)(
            lhs, rhs, dimension_numbers, precision, preferred_element_type,
            fp8_state=fp8.Fp8DotState(hist.value))


def _fp8_overrides(module: nn.Module, recipe: fp8.FP8Recipe, fields: set[str]
                   ) -> dict[str, Any]:
    """Routes a Dense/DenseGeneral matmul through ``fmtkit.fp8`` (others: unchanged)."""
    if "dot_general" not in fields:
        return {}
    if recipe.delayed:
        if "dot_general_cls" not in fields:
            return {}
        return {"dot_general_cls": functools.partial(Fp8DelayedDotGeneral, recipe=recipe)}
    return {"dot_general": fp8.dot_general(recipe)}


def _overrides(module: nn.Module, policy: Policy) -> dict[str, Any]:
    attrs: dict[str, Any] = {"param": _casting_param(module, policy)}
    fields = {f.name for f in dataclasses.fields(module)}
    cdt = jnp.dtype(policy.compute_dtype)
    if "dtype" in fields:
        attrs["dtype"] = cdt
    if policy.fp8 is not None:
        attrs.update(_fp8_overrides(module, policy.fp8, fields))
    if (isinstance(module, nn.MultiHeadDotProductAttention) and cdt != jnp.float32
            and module.qk_attn_weights_einsum_cls is None
            and module.attn_weights_value_einsum_cls is None and module.precision is None
            and module.attention_fn is nn.dot_product_attention):
        attrs["force_fp32_for_softmax"] = True
        attrs["qk_attn_weights_einsum_cls"] = _qk_einsum
        attrs["attn_weights_value_einsum_cls"] = _pv_einsum_cast
    return attrs


def _make_interceptor(rules: Rules, visited: dict[str, tuple[str, ...]]):
    def interceptor(next_fun, args, kwargs, context):
        module, name = context.module, context.method_name
        if (name == "<lambda>" or isinstance(module, PolicyModule | Fp8DelayedDotGeneral)
                or (name.startswith("_") and name != "__call__")):
            return next_fun(*args, **kwargs)
        path = module_path(module)
        names = type_names(type(module))
        visited.setdefault(path, names)
        policy = rules.resolve(path, names)
        if name == "setup":  # parameters created in setup are read here
            if policy is None:
                return next_fun(*args, **kwargs)
            with _instance_attrs(module, {"param": _casting_param(module, policy)}):
                return next_fun(*args, **kwargs)

        def call(*a, **k):
            if policy is None:
                return next_fun(*a, **k)
            with _instance_attrs(module, _overrides(module, policy)):
                return next_fun(*a, **k)

        return _runtime.run_module(
            call, args, kwargs, path=path, type_name=names[0] if names else type(module).__name__,
            policy=policy, flax_defined=_runtime.is_flax_defined(type(module), name),
            is_leaf=_is_module)

    return interceptor


def _is_module(x) -> bool:
    return isinstance(x, nn.Module)


class PolicyModule(nn.Module):
    """A linen module that runs ``inner`` under ``rules``; made by ``with_policy``.

    Its variables are exactly ``inner``'s (``nn.share_scope``), so ``init``/``apply``, optax and
    checkpoints are unchanged; ``jax.jit(wrapped.apply)`` works as is.

    Attributes:
      inner: the unmodified model.
      rules: the policy rules.
      strict: raise (instead of warning) when a rule pattern matches no module.
    """

    inner: nn.Module
    rules: Rules
    strict: bool = False

    def setup(self):
        nn.share_scope(self, self.inner)

    def __call__(self, *args, **kwargs):
        visited: dict[str, tuple[str, ...]] = {}
        with nn.intercept_methods(_make_interceptor(self.rules, visited)):
            out = self.inner(*args, **kwargs)
        report_unmatched(self.rules, visited, self.strict)
        return out


def collect_paths(model: nn.Module, *inputs, **kwargs) -> dict[str, tuple[str, ...]]:
    """Paths and class names of the modules ``model`` calls on ``inputs`` (abstract init)."""
    import jax

    inner = model.inner if isinstance(model, PolicyModule) else model
    visited: dict[str, tuple[str, ...]] = {}

    def interceptor(next_fun, args, kw, context):
        module, name = context.module, context.method_name
        if (name not in ("<lambda>", "setup") and not name.startswith("_")) or name == "__call__":
            visited.setdefault(module_path(module), type_names(type(module)))
        return next_fun(*args, **kw)

    def init():
        keys = {"params": jax.random.key(0), "dropout": jax.random.key(1)}
        return inner.init(keys, *inputs, **kwargs)

    with nn.intercept_methods(interceptor):
        jax.eval_shape(init)
    return visited
