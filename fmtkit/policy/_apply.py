"""``with_policy`` and ``module_paths``: dispatch to the linen, NNX or function adapter."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.extend.core
import jax.numpy as jnp

from fmtkit.policy import _eager, _scopes, _trace, _trace_cache
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
    if _is_hf_flax_model(model):
        raise TypeError(_HF_WRAPPING.format(argname=argname,
                                            cls=type(model).__qualname__))
    if callable(model) and not isinstance(model, type):
        return "function"
    raise TypeError(
        f"{argname} must be a flax.linen.Module or flax.nnx.Module instance or a JAX function, "
        f"got {type(model).__module__}.{type(model).__qualname__}.")


def _is_hf_flax_model(model: Any) -> bool:
    """Whether ``model`` looks like a Hugging Face Flax model (``FlaxPreTrainedModel``): not
    a module itself, it holds a linen module (``.module``), its parameters (``.params``) and a
    ``.config``, and its ``__call__`` takes the parameters by keyword (``params=``). Duck-typed:
    fmtkit does not import transformers."""
    import flax.linen as nn

    return (not isinstance(model, type) and isinstance(getattr(model, "module", None), nn.Module)
            and hasattr(model, "params") and hasattr(model, "config"))


# transformers' FlaxPreTrainedModel.__call__ runs
# ``self.module.apply({"params": params or self.params}, input_ids, ..., deterministic=not
# train, rngs=rngs)`` (e.g. models/bert/modeling_flax_bert.py): the module and that
# variables dict are what a policy can see.
_HF_WRAPPING = (
    "{argname} is a Hugging Face Flax model ({cls}), not a Flax module: its __call__ takes "
    "the parameters by keyword (params=), which a policy cannot see as parameters, so no "
    "matmul would be a projection (no FP8, nothing cast at use). Wrap its linen module and "
    "apply it with the parameters, as the model's __call__ does: policied = "
    "with_policy(hf_model.module, rules); policied.apply({{\"params\": hf_model.params}}, "
    "input_ids, attention_mask, ..., deterministic=True) (the module's own arguments; "
    "policied.init gives the same variables). Or wrap a function that takes the parameters "
    "first: with_policy(lambda params, *inputs: hf_model(*inputs, params=params), "
    "rules)(hf_model.params, input_ids, attention_mask).")


def with_policy(model: Any, policy_or_rules: Policy | Rules | str | Any, *,
                strict: bool = False, params_argnums: Any = "auto",
                cache_traces: bool = True) -> Any:
    """Applies a precision policy to an unmodified Flax linen or NNX model or a JAX function.

    The policy decides per *operation*, wherever the model writes it (inside Flax layers, in
    a hand-written ``__call__``, in a plain function), as PyTorch's autocast does:

    * matmuls (every ``dot_general`` — ``jnp.einsum``, ``@``, Dense, Einsum, ``attend`` — and
      convolutions) take operands in the compute dtype of the module they are written in, or
      its FP8 recipe when one of their operands is a parameter (a projection; convolutions
      stay on the compute dtype, with one warning per call naming their modules);
    * precision-sensitive ops (exp, log, log1p, expm1, rsqrt, pow, and every sum, mean, max
      and cumulative sum: softmax, log-softmax, norm statistics, the loss) run in f32 and
      their outputs stay f32 until the next matmul casts its own inputs;
    * an upcast the author wrote is kept (a matmul fed an f32 value made by the author's
      ``astype`` is not cast down); everything else follows its inputs;
    * what the author asked for explicitly is kept: a ``preferred_element_type`` wider than
      the operands, ``jax.nn.dot_product_attention``'s f32 logits, ``precision=HIGHEST`` or a
      dot algorithm that excludes the compute dtype (honoured, with a warning naming the
      module); FFT, linear algebra (``eigh``, ``svd``, solves) and host callbacks run in
      their traced dtypes; complex matmuls as traced; ``lax.ragged_dot`` (grouped GEMMs) on
      the compute dtype, as ``fmtkit.fp8.ragged_dot`` under FP8 presets; a one-hot
      embedding lookup is not a projection (never FP8);
    * ``custom_vjp``/``custom_jvp`` rules are interpreted too (their matmuls on the compute
      dtype), and a policied function called inside another keeps its own policy;
    * the output head (the matmul that produces the model's outputs: lm1b's ``logitdense``, a
      tied-embedding ``attend``) is found by its role and gets ``Rules.head`` (presets: half
      operands, f32 logits, never FP8);
    * per module (first matching rule, else the default): parameters are stored in
      ``param_dtype``, floating outputs leaving the module are cast to ``output_dtype``, and
      their cotangents rounded through ``grad_dtype``.

    Parameters, the same in every frontend: a policy never converts the parameters it is
    given. Where it creates them (linen ``init``) they are stored in ``param_dtype``; an NNX
    model's Params that the rules store narrower (f32 under pure-bf16) are converted copies
    held by the policied model, so the user's model is never changed. A parameter *narrower*
    than its module's ``param_dtype`` (a bf16 checkpoint under a mixed preset) raises a
    ``ValueError`` naming the leaves: JAX returns gradients in each parameter's own dtype, so
    it would train in bf16 without the f32 master copy the preset promises. Wider ones are
    used as given and cast to the compute dtype at use.

    A plain function: only the parameter argument(s) count as parameters (cast to the compute
    dtype at use, the projection test of FP8 recipes); data arguments follow the ops, as a
    model's inputs do. Linen variables among them count by their ``"params"`` collection.
    Under a delayed FP8 recipe the function takes its amax histories explicitly: ``state =
    policied.init_fp8_state(*args)`` (zeros, by tracing), ``policied(*args,
    fp8_state=state)``; differentiate the loss with respect to the state too and record the
    "gradient" with ``fmtkit.fp8.update_state(state, observed)`` once per step (the linen
    protocol, for plain functions and Equinox-style models alike).

    ``fmtkit.policy`` documents the op table and the mechanism (the model is traced once and
    its jaxpr re-interpreted under the rules); it works under ``jax.jit``, ``jax.grad``,
    ``jax.vmap``, linen ``nn.scan``/``nn.remat`` and NNX ``nnx.scan``/``nnx.vmap``/``nnx.remat``.

    Args:
      model: a ``flax.linen.Module`` or ``flax.nnx.Module`` instance, unmodified, or a plain
        JAX function of pytrees (e.g. ``apply(params, x)``, ``loss(params, batch)``, ``lambda
        m, x: m(x)`` for an Equinox-style model; module paths inside it come from linen
        modules it applies).
      policy_or_rules: a preset name (``list_presets()``), ``Rules``, a ``Policy`` (every
        module; no head or output rule), a policy string ("p=f32,c=bf16"), or a list of
        ``(pattern, policy)`` pairs (modules no pattern matches run untouched).
      strict: raise ``ValueError`` instead of warning when a user pattern matches no module.
      params_argnums: functions only: the positional argument(s) holding parameters, an int
        or a sequence (``()``: none). "auto" (default): the first argument when the function
        is called with two or more positional arguments (``apply(params, x)``), none when
        called with one (``f(x)``: data; under an FP8 policy that warns, since no matmul
        then has a parameter operand); say ``params_argnums=0`` for ``f(params)``. Under
        every frontend an FP8/FP4 policy that finds no projection (no matmul it covers has
        a parameter operand) warns: nothing would run in FP8.
      cache_traces: keep the model's traced jaxpr per input signature, as ``jax.jit`` keeps
        its traces (key: the model — a linen module by value, an NNX graphdef, a function
        object — the arguments' tree structure, array shapes/dtypes/shardings, and the
        values of Python scalars among them): a second trace with the same signature (an
        eval step, a fresh ``jit`` of the step) re-interprets the kept jaxpr without running
        the model's Python again. ``jax.jit``'s caveat applies: a model whose Python reads a
        global or a mutable object that changes between calls is not re-traced, and its
        Python side effects happen on the first trace only; pass False for such a model.

    Returns:
      linen: a ``PolicyModel`` with ``init``/``apply`` as the module's (same variables, plus
      ``"fp8_state"`` under a delayed FP8 recipe). NNX: a copy of the module graph sharing
      the model's Variables (but for the converted Params above). A function: a function with
      the same signature (plus the keyword ``fp8_state`` and the attribute
      ``init_fp8_state`` under a delayed FP8 recipe).

    Raises:
      TypeError: ``model`` is not a Flax module or a function; a rule is malformed; a Hugging
        Face Flax model object (its parameters go by keyword: the message says how to wrap
        its ``.module``).
      ValueError: unknown preset (a near miss gets "did you mean"), a bare dtype name
        ("bf16": say "bf16-mixed" or ``Policy.parse("p=bf16")``), FP8 dtype, invalid regex,
        already-wrapped model, parameters narrower than their ``param_dtype`` (at wrap for
        NNX, at the call otherwise).

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
    if not isinstance(cache_traces, bool):
        raise TypeError(f"cache_traces must be a bool, got {type(cache_traces).__name__}.")
    if kind != "function" and _param_argnums(params_argnums) != _AUTO:
        raise TypeError(f"params_argnums is for plain functions; a {kind} model knows its "
                        "parameters (linen: variables['params']; NNX: its nnx.Param).")
    rules = as_rules(policy_or_rules)
    if kind == "linen":
        from fmtkit.policy import _linen

        if isinstance(model, _linen.PolicyModel):
            raise ValueError("This linen model already has a policy (it is a PolicyModel); "
                             "apply with_policy once, to the unwrapped model, with all rules.")
        return _linen.PolicyModel(inner=model, rules=rules, strict=strict,
                                  cache_traces=cache_traces)
    if kind == "nnx":
        from fmtkit.policy import _nnx

        return _nnx.wrap(model, rules, strict, cache_traces)
    return _policied_function(model, rules, strict, params_argnums, cache_traces)


_AUTO = "auto"


def _param_argnums(value: Any) -> tuple[int, ...] | str:
    """Validates ``params_argnums``: "auto", an int, or a sequence of ints (may be empty)."""
    if value is None or (isinstance(value, str) and value == _AUTO):
        return _AUTO
    if isinstance(value, int) and not isinstance(value, bool):
        value = (value,)
    if (isinstance(value, Sequence) and not isinstance(value, str)
            and all(isinstance(i, int) and not isinstance(i, bool) for i in value)):
        return tuple(value)
    raise TypeError("params_argnums must be 'auto', an int or a sequence of ints (positional "
                    f"argument indices; () for no parameters), got {value!r}.")


def _param_args(argnums: tuple[int, ...] | str, args: tuple) -> tuple[int, ...]:
    if argnums == _AUTO:
        return (0,) if len(args) >= 2 else ()
    for i in argnums:
        if not -len(args) <= i < len(args):
            raise ValueError(f"params_argnums={argnums} names argument {i}, but the function "
                             f"was called with {len(args)} positional argument(s).")
    return tuple(sorted({i % len(args) for i in argnums}))


def _is_linen_variables(x: Any) -> bool:
    return isinstance(x, Mapping) and "params" in x


def _param_leaves(args: tuple, argnums: tuple[int, ...]) -> list[tuple[tuple[str, ...], Any]]:
    """``(key names, leaf)`` of the parameter leaves (linen variables: their "params")."""
    out = []
    for i in argnums:
        tree = args[i]["params"] if _is_linen_variables(args[i]) else args[i]
        for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
            out.append((tuple(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))))
                              for k in path), leaf))
    return out


def _has_matmul(traced: Any) -> bool:
    """Whether the trace holds a ``dot_general`` (at any depth)."""
    def walk(jaxpr) -> bool:
        return any(e.primitive.name == "dot_general"
                   or any(walk(j.jaxpr if hasattr(j, "jaxpr") else j)
                          for j in jax.extend.core.jaxprs_in_params(e.params))
                   for e in jaxpr.eqns)

    return walk(traced.closed.jaxpr)


def _policied_function(fn: Any, rules: Rules, strict: bool, params_argnums: Any,
                       cache_traces: bool = True) -> Any:
    from fmtkit.policy import _linen
    from fmtkit.policy._policy import has_delayed_fp8, is_identity

    if getattr(fn, "_fmtkit_rules", None) is not None:
        raise ValueError("This function already has a policy (with_policy was applied to it); "
                         "apply with_policy once, to the plain function, with all rules.")
    if isinstance(getattr(fn, "__self__", None), _linen.PolicyModel):
        raise ValueError("This is the apply of a linen model that already has a policy; "
                         "apply with_policy once, to the unwrapped model, with all rules.")
    argnums_spec = _param_argnums(params_argnums)
    eager_calls = _eager.EagerCache()
    traces = _trace_cache.TraceCache() if cache_traces else None
    delayed = has_delayed_fp8(rules)
    identity = is_identity(rules)
    has_fp8 = any(p is not None and p.fp8 is not None
                  for p in (rules.default, *(p for _, p in rules.rules)))

    def call(*args, **kwargs):
        with _linen.scoped():
            return fn(*args, **kwargs)

    def traced_call(args, kwargs):
        argnums = _param_args(argnums_spec, args)

        def is_param(path, leaf) -> bool:
            # trace(call, args, kwargs) flattens (args, kwargs): path[0] is args (index 0),
            # path[1] the argument; of linen variables only the "params" collection counts.
            if len(path) < 2 or getattr(path[0], "idx", None) != 0:
                return False
            i = getattr(path[1], "idx", None)
            if i not in argnums:
                return False
            if _is_linen_variables(args[i]):
                return len(path) > 2 and getattr(path[2], "key", None) == "params"
            return True

        traced = _trace.trace(call, args, kwargs, is_param=is_param, cache=traces)
        if has_fp8 and not argnums and argnums_spec == _AUTO and _has_matmul(traced):
            warnings.warn(
                "with_policy: this function was called with one positional argument, which "
                "params_argnums='auto' counts as data, so no matmul has a parameter operand "
                "and the policy's FP8 recipe runs on none of them. If the argument holds "
                "parameters (f(params)), pass params_argnums=0; to silence this for data, "
                "params_argnums=().", UserWarning, stacklevel=3)
        plan = traced.plan(rules)
        plan.report_unmatched(strict)
        plan.check_param_dtypes(_param_leaves(args, argnums),
                                f"the parameter argument(s) {list(argnums)}")
        return traced, plan

    @functools.wraps(fn)
    def policied(*args, **kwargs):
        fp8_state = kwargs.pop("fp8_state", None) if delayed else None
        if delayed:
            if fp8_state is None:
                raise ValueError(
                    "This policy has a delayed FP8 recipe, which keeps an amax history per "
                    "matmul: pass them as the keyword fp8_state "
                    "(state = policied.init_fp8_state(*args); policied(*args, "
                    "fp8_state=state)), differentiate the loss with respect to it too, and "
                    "record the observed amaxes with fmtkit.fp8.update_state(state, "
                    "grad_of_state) once per step.")
            if not isinstance(fp8_state, Mapping):
                raise TypeError("fp8_state must be the dict init_fp8_state returns, got "
                                f"{type(fp8_state).__name__}.")

        def call(tree, nested=False):
            a, k, state = tree
            # (one positional argument under "auto": traced_call has said why no matmul has
            # a parameter operand)
            said = argnums_spec == _AUTO and not _param_args(argnums_spec, a)
            out, _ = _trace.run(*traced_call(a, k),
                                fp8_state=dict(state) if state is not None else None,
                                nested=nested, warn_no_projection=not said)
            return out

        if _scopes.is_tracing():
            # Called inside another policied model's trace: this policy decides the ops it
            # binds (their scope tells the outer policy to keep them as traced), as a nested
            # autocast region does. Its outputs are not the model's, so none of its matmuls is
            # the output head by role (only by mark_head): its FP8 recipe covers them all.
            # inspect_policy reads each op under the op scope this call records it with.
            _scopes.note_nested_call()
            with jax.named_scope(_scopes.NESTED_SCOPE):
                return call((args, kwargs, fp8_state), nested=True)

        # Eager calls: compiled once per input signature (fmtkit.policy._eager); under rules
        # that change nothing ("fp32"), op by op, as the unwrapped function runs.
        if identity:
            return call((args, kwargs, fp8_state))
        cached, out = eager_calls(call, (args, kwargs, fp8_state))
        return out if cached else call((args, kwargs, fp8_state))

    def init_fp8_state(*args, **kwargs) -> dict:
        """The delayed-FP8 amax histories of a call on these arguments: ``{slot: zeros
        f32[*layers, 3, history]}`` (empty without a delayed recipe); traced, not run."""
        if not delayed:
            return {}
        slots = _trace.fp8_slots(*traced_call(args, kwargs),
                                 nested=_scopes.is_tracing())
        return {k: jnp.zeros(shape, jnp.float32) for k, shape in slots.items()}

    policied._fmtkit_rules = rules  # type: ignore[attr-defined]
    policied.init_fp8_state = init_fp8_state  # type: ignore[attr-defined]
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
