"""``with_policy`` and ``module_paths``: dispatch to the linen, NNX or function adapter."""

from __future__ import annotations

import functools
from typing import Any

from fmtkit.policy import _interpret
from fmtkit.policy._policy import Policy, Rules, as_rules

__all__ = ["module_paths", "with_policy"]


def flax_kind(model: Any, argname: str = "model") -> str:
    """``"linen"``, ``"nnx"`` or ``"function"``; TypeError for anything else."""
    import flax.linen as nn
    from flax import nnx

    from fmtkit.policy import _linen

    if isinstance(model, nn.Module | _linen.PolicyModel):
        return "linen"
    if isinstance(model, nnx.Module):
        return "nnx"
    if isinstance(model, type) and issubclass(model, (nn.Module, nnx.Module)):
        raise TypeError(f"{argname} must be a Flax module instance, got the class "
                        f"{model.__name__}; instantiate it first.")
    if callable(model) and not isinstance(model, type):
        return "function"
    raise TypeError(
        f"{argname} must be a flax.linen.Module or flax.nnx.Module instance or a JAX function, "
        f"got {type(model).__module__}.{type(model).__qualname__}.")


def with_policy(model: Any, policy_or_rules: Policy | Rules | str | Any, *,
                strict: bool = False) -> Any:
    """Applies a precision policy to an unmodified Flax linen or NNX model or a JAX function.

    The policy decides per *operation*, wherever the model writes it (inside Flax layers, in
    a hand-written ``__call__``, in a plain function), as PyTorch's autocast does:

    * matmuls (every ``dot_general`` — ``jnp.einsum``, ``@``, Dense, Einsum, ``attend`` — and
      convolutions) take operands in the compute dtype of the module they are written in, or
      its FP8 recipe when one of their operands is a parameter (a projection);
    * precision-sensitive ops (exp, log, log1p, expm1, rsqrt, pow, and every sum, mean, max
      and cumulative sum: softmax, log-softmax, norm statistics, the loss) run in f32 and
      their outputs stay f32 until the next matmul casts its own inputs;
    * an upcast the author wrote is kept (a matmul fed an f32 value made by the author's
      ``astype`` is not cast down); everything else follows its inputs;
    * the output head (the matmul that produces the model's outputs: lm1b's ``logitdense``, a
      tied-embedding ``attend``) is found by its role and gets ``Rules.head`` (presets: half
      operands, f32 logits, never FP8);
    * per module (first matching rule, else the default): parameters are stored in
      ``param_dtype``, floating outputs leaving the module are cast to ``output_dtype``, and
      their cotangents rounded through ``grad_dtype``.

    ``fmtkit.policy`` documents the op table and the mechanism (the model is traced once and
    its jaxpr re-interpreted under the rules); it works under ``jax.jit``, ``jax.grad``,
    ``jax.vmap``, linen ``nn.scan``/``nn.remat`` and NNX ``nnx.scan``/``nnx.vmap``/``nnx.remat``.

    Args:
      model: a ``flax.linen.Module`` or ``flax.nnx.Module`` instance, unmodified, or a plain
        JAX function of pytrees (e.g. ``apply(params, x)`` or a loss function; module paths
        inside it come from linen modules it applies; every array argument counts as a
        parameter for the FP8 projection test).
      policy_or_rules: a preset name (``list_presets()``), ``Rules``, a ``Policy`` (every
        module; no head or output rule), a policy string ("p=f32,c=bf16"), or a list of
        ``(pattern, policy)`` pairs (modules no pattern matches run untouched).
      strict: raise ``ValueError`` instead of warning when a user pattern matches no module.

    Returns:
      linen: a ``PolicyModel`` with ``init``/``apply`` as the module's (same variables, plus
      ``"fp8_state"`` under a delayed FP8 recipe). NNX: a ``PolicyModel`` module holding the
      model (same Variables). A function: a function with the same signature.

    Raises:
      TypeError: ``model`` is not a Flax module or a function; a rule is malformed.
      ValueError: unknown preset, a bare dtype name ("bf16": say "bf16-mixed" or
        ``Policy.parse("p=bf16")``), FP8 dtype, invalid regex, already-wrapped model.

    Example:
      >>> import jax, jax.numpy as jnp, flax.linen as nn
      >>> model = with_policy(nn.Dense(4), "bf16-mixed")
      >>> x = jnp.ones((2, 3))
      >>> params = model.init(jax.random.key(0), x)
      >>> params["params"]["kernel"].dtype, model.apply(params, x).dtype
      (dtype('float32'), dtype('float32'))
    """
    kind = flax_kind(model)
    if not isinstance(strict, bool):
        raise TypeError(f"strict must be a bool, got {type(strict).__name__}.")
    rules = as_rules(policy_or_rules)
    if kind == "linen":
        from fmtkit.policy import _linen

        if isinstance(model, _linen.PolicyModel):
            raise ValueError("This linen model already has a policy (it is a PolicyModel); "
                             "apply with_policy once, to the unwrapped model, with all rules.")
        return _linen.PolicyModel(inner=model, rules=rules, strict=strict)
    if kind == "nnx":
        from fmtkit.policy import _nnx

        return _nnx.wrap(model, rules, strict)
    return _policied_function(model, rules, strict)


def _policied_function(fn: Any, rules: Rules, strict: bool) -> Any:
    from fmtkit.policy import _linen
    from fmtkit.policy._policy import report_unmatched

    if getattr(fn, "_fmtkit_rules", None) is not None:
        raise ValueError("This function already has a policy (with_policy was applied to it); "
                         "apply with_policy once, to the plain function, with all rules.")
    if isinstance(getattr(fn, "__self__", None), _linen.PolicyModel):
        raise ValueError("This is the apply of a linen model that already has a policy; "
                         "apply with_policy once, to the unwrapped model, with all rules.")

    def call(*args, **kwargs):
        with _linen.scoped():
            return fn(*args, **kwargs)

    @functools.wraps(fn)
    def policied(*args, **kwargs):
        traced = _interpret.trace(call, args, kwargs)
        report_unmatched(rules, traced.registry.visited() or {"": ()}, strict)
        out, _ = _interpret.run(traced, rules)
        return out

    policied._fmtkit_rules = rules  # type: ignore[attr-defined]
    return policied


def module_paths(model: Any, *example_inputs: Any, **kwargs: Any) -> dict[str, str]:
    """The module paths of a model, for writing rules: ``{path: class name}``.

    linen: the modules called when ``model`` is initialized on ``example_inputs`` (traced
    abstractly with ``jax.eval_shape``; arrays or ``jax.ShapeDtypeStruct``; ``kwargs`` go to
    the call); modules inside ``nn.scan``/``nn.vmap`` appear once, without a layer index.
    NNX: every module of the graph (no inputs needed). The model itself is ``""``.

    Example:
      >>> import jax.numpy as jnp, flax.linen as nn
      >>> module_paths(nn.Sequential([nn.Dense(3), nn.Dense(2)]), jnp.ones((1, 4)))
      {'': 'Sequential', 'layers_0': 'Dense', 'layers_1': 'Dense'}
    """
    kind = flax_kind(model)
    if kind == "function":
        raise TypeError("module_paths needs a Flax model; a plain function has no modules.")
    if kind == "linen":
        from fmtkit.policy import _linen

        found = _linen.collect_paths(model, *example_inputs, **kwargs)
    else:
        from fmtkit.policy import _nnx

        if example_inputs or kwargs:
            raise TypeError("module_paths of an NNX model takes no example inputs: its modules "
                            "are known from the graph.")
        found = _nnx.collect_paths(model)
    return {path: (names[0] if names else "?") for path, names in found.items()}
