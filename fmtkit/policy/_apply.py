"""``with_policy`` and ``module_paths``: dispatch to the linen, NNX or function adapter.

The path of the rules, forward, from ``with_policy(model, rules)`` to the interpreter's walk
(each stop a module of this package; each returns its result to the frontend that called it):

1. ``_apply.with_policy``: the rules parsed (``_policy.as_rules``), the model's kind found,
   its frontend's ``wrap`` called (``_frontends.linen``, ``_frontends.nnx`` or
   ``_frontends.functions``). NNX resolves the rules against its graph here already
   (step 3, for the report of unmatched patterns and the Params it stores narrower).
2. The frontend, at each call of the policied model: traces the model
   (``_engine.trace.trace``, returning a ``Traced``: the jaxpr and the modules it called).
   NNX knows its modules from its graph and resolves first (step 3), then traces.
3. ``_plan.resolve_rules``: the rules resolved against those modules into a ``Plan`` (kept
   per rules and modules), the patterns that matched nothing reported, the parameters
   checked against their modules' ``param_dtype``; it returns the plan to the frontend.
4. ``_engine.runner.run(traced, plan)``: the frontend hands the trace and the plan forward;
   the runner analyzes the trace and builds the ``_engine.interpreter.Interpreter`` with the
   plan, whose walk (``Interpreter.run``) binds every equation again, reading each module's
   policy from the plan; matmuls go to ``_engine.matmul``, bodies to their handlers
   (``_engine.handlers``).

From the frontend on, the frontend is returned to twice (after the trace and after the
resolution) and no other file is entered twice: the engine never resolves rules, and the
frontends call into the plan only through ``resolve_rules``
(``tests/policy/test_plan_path.py``). Two side paths: linen ``init`` and the NNX wrapper
read the plan to store parameters (``Plan.policy``), and the first call under a delayed FP8
recipe asks ``runner.fp8_slots`` for the shapes of the amax histories it creates.
"""

from __future__ import annotations

from typing import Any

from fmtkit.policy._frontends import functions
from fmtkit.policy._frontends.functions import AUTO, param_argnums
from fmtkit.policy._frontends.protocol import Frontend
from fmtkit.policy._policy import Policy, Rules, as_rules

__all__ = ["module_paths", "with_policy"]


def flax_kind(model: Any, argname: str = "model") -> str:
    """``"linen"``, ``"nnx"`` or ``"function"``; TypeError for anything else."""
    import flax.linen as nn
    from flax import nnx

    from fmtkit.policy._frontends import linen

    if isinstance(model, nn.Module | linen.PolicyModel):
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
    if kind != "function" and param_argnums(params_argnums) != AUTO:
        raise TypeError(f"params_argnums is for plain functions; a {kind} model knows its "
                        "parameters (linen: variables['params']; NNX: its nnx.Param).")
    rules = as_rules(policy_or_rules)
    return frontend(kind).wrap(model, rules, strict=strict, cache_traces=cache_traces,
                               params_argnums=params_argnums)


def frontend(kind: str) -> Frontend:
    """The frontend of a kind of model (``flax_kind``), loaded when first asked for (linen and
    NNX import Flax)."""
    if kind == "linen":
        from fmtkit.policy._frontends import linen

        return linen
    if kind == "nnx":
        from fmtkit.policy._frontends import nnx as nnx_frontend

        return nnx_frontend
    return functions


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
    found = frontend(kind).collect_paths(model, *example_inputs, **kwargs)
    return {path: (names[0] if names else "?") for path, names in found.items()}
