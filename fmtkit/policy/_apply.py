"""``with_policy`` and ``module_paths``: dispatch to the linen or NNX adapter."""

from __future__ import annotations

from typing import Any

from fmtkit.policy._policy import Policy, Rules, as_rules

__all__ = ["module_paths", "with_policy"]


def flax_kind(model: Any, argname: str = "model") -> str:
    """``"linen"`` or ``"nnx"``; TypeError for anything else."""
    import flax.linen as nn
    from flax import nnx

    if isinstance(model, nn.Module):
        return "linen"
    if isinstance(model, nnx.Module):
        return "nnx"
    if isinstance(model, type) and issubclass(model, (nn.Module, nnx.Module)):
        raise TypeError(f"{argname} must be a Flax module instance, got the class "
                        f"{model.__name__}; instantiate it first.")
    raise TypeError(
        f"{argname} must be a flax.linen.Module or flax.nnx.Module instance, got "
        f"{type(model).__module__}.{type(model).__qualname__}. (For a bare apply function, "
        "wrap the model that defines it.)")


def with_policy(model: Any, policy_or_rules: Policy | Rules | str | Any, *,
                strict: bool = False) -> Any:
    """Applies a precision policy to an unmodified Flax linen or NNX model.

    Per module (the first rule whose pattern matches its path or class name, else the
    default), for every call:

    * parameters are stored in ``param_dtype`` (linen: created so at ``init``; NNX: cast once,
      here) and cast to ``compute_dtype`` at use, so gradients arrive in the stored dtype;
    * floating inputs are cast to ``compute_dtype`` and Flax layers' ``dtype`` is set to it,
      so their matmuls take ``compute_dtype`` operands;
    * floating outputs are cast to ``output_dtype``;
    * on the backward pass the cotangent of the module's outputs is rounded through
      ``grad_dtype`` (a custom-JVP identity; JAX keeps a cotangent in its primal's dtype).

    Flax's own layers run under "standard" dtype promotion (several of them raise under
    "strict" once given bf16); user modules keep the caller's mode. Flax's multi-head
    attention keeps its softmax in f32 (QK^T accumulated in f32, PV on compute-dtype operands).

    Args:
      model: a ``flax.linen.Module`` or ``flax.nnx.Module`` instance, unmodified.
      policy_or_rules: a ``Policy`` (every module), ``Rules``, a preset name
        (``list_presets()``), a policy string ("p=f32,c=bf16"), or a list of
        ``(pattern, policy)`` pairs (modules no pattern matches run untouched).
      strict: raise ``ValueError`` instead of warning when a user pattern matches no module
        (linen: checked when the model is first traced; NNX: here).

    Returns:
      linen: a ``PolicyModule`` with the same variables as ``model`` (``init``/``apply`` as
      usual; ``jax.jit(wrapped.apply)`` works). NNX: a copy of the model's module graph that
      shares the original's Variables (so training either updates both), with the policy
      applied; its graphdef is not picklable.

    Raises:
      TypeError: ``model`` is not a Flax module; a rule is malformed.
      ValueError: unknown preset or dtype, FP8 dtype, invalid regex, already-wrapped model.

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

        if isinstance(model, _linen.PolicyModule):
            raise ValueError("This linen model already has a policy (it is a PolicyModule); "
                             "apply with_policy once, to the unwrapped model, with all rules.")
        return _linen.PolicyModule(inner=model, rules=rules, strict=strict)
    from fmtkit.policy import _nnx

    return _nnx.wrap(model, rules, strict)


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
