"""The plain-function frontend: ``with_policy`` of a JAX function of pytrees.

Only the parameter argument(s) (``params_argnums``) count as parameters; module paths come
from linen modules the function applies (``linen.scoped``). Under a delayed FP8 recipe the
function takes its amax histories explicitly (``fp8_state=``, ``init_fp8_state``).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.extend.core
import jax.numpy as jnp

from fmtkit.policy._engine import caches, runner, scopes, trace
from fmtkit.policy._plan import resolve_rules
from fmtkit.policy._policy import Rules, has_delayed_fp8, is_identity

AUTO = "auto"


def param_argnums(value: Any) -> tuple[int, ...] | str:
    """Validates ``params_argnums``: "auto", an int, or a sequence of ints (may be empty)."""
    if value is None or (isinstance(value, str) and value == AUTO):
        return AUTO
    if isinstance(value, int) and not isinstance(value, bool):
        value = (value,)
    if (isinstance(value, Sequence) and not isinstance(value, str)
            and all(isinstance(i, int) and not isinstance(i, bool) for i in value)):
        return tuple(value)
    raise TypeError("params_argnums must be 'auto', an int or a sequence of ints (positional "
                    f"argument indices; () for no parameters), got {value!r}.")


def _param_args(argnums: tuple[int, ...] | str, args: tuple) -> tuple[int, ...]:
    if argnums == AUTO:
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


def collect_paths(model: Any, *example_inputs: Any, **kwargs: Any) -> dict[str, tuple[str, ...]]:
    raise TypeError("module_paths needs a Flax model; a plain function has no modules.")


def is_wrapped(obj: Any) -> bool:
    return getattr(obj, "_fmtkit_rules", None) is not None


def wrap(model: Any, rules: Rules, *, strict: bool, cache_traces: bool = True,
         params_argnums: Any = AUTO) -> Any:
    """The function ``model`` under ``rules`` (``with_policy`` of a plain function)."""
    fn = model
    from fmtkit.policy._frontends import linen

    if is_wrapped(fn):
        raise ValueError("This function already has a policy (with_policy was applied to it); "
                         "apply with_policy once, to the plain function, with all rules.")
    if isinstance(getattr(fn, "__self__", None), linen.PolicyModel):
        raise ValueError("This is the apply of a linen model that already has a policy; "
                         "apply with_policy once, to the unwrapped model, with all rules.")
    argnums_spec = param_argnums(params_argnums)
    eager_calls = caches.EagerCache()
    traces = caches.TraceCache() if cache_traces else None
    delayed = has_delayed_fp8(rules)
    identity = is_identity(rules)
    has_fp8 = any(p is not None and p.fp8 is not None
                  for p in (rules.default, *(p for _, p in rules.rules)))

    def call(*args, **kwargs):
        with linen.scoped():
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

        traced = trace.trace(call, args, kwargs, is_param=is_param, cache=traces)
        if has_fp8 and not argnums and argnums_spec == AUTO and _has_matmul(traced):
            warnings.warn(
                "with_policy: this function was called with one positional argument, which "
                "params_argnums='auto' counts as data, so no matmul has a parameter operand "
                "and the policy's FP8 recipe runs on none of them. If the argument holds "
                "parameters (f(params)), pass params_argnums=0; to silence this for data, "
                "params_argnums=().", UserWarning, stacklevel=3)
        plan = resolve_rules(rules, traced.modules, strict=strict,
                             params=_param_leaves(args, argnums),
                             what=f"the parameter argument(s) {list(argnums)}")
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
            said = argnums_spec == AUTO and not _param_args(argnums_spec, a)
            out, _ = runner.run(*traced_call(a, k),
                                 fp8_state=dict(state) if state is not None else None,
                                 nested=nested, warn_no_projection=not said)
            return out

        if scopes.is_tracing():
            # Called inside another policied model's trace: this policy decides the ops it
            # binds (their scope tells the outer policy to keep them as traced), as a nested
            # autocast region does. Its outputs are not the model's, so none of its matmuls is
            # the output head by role (only by mark_head): its FP8 recipe covers them all.
            # inspect_policy reads each op under the op scope this call records it with.
            scopes.note_nested_call()
            with jax.named_scope(scopes.NESTED_SCOPE):
                return call((args, kwargs, fp8_state), nested=True)

        # Eager calls: compiled once per input signature (caches.EagerCache); under rules
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
        slots = runner.fp8_slots(*traced_call(args, kwargs),
                                  nested=scopes.is_tracing())
        return {k: jnp.zeros(shape, jnp.float32) for k, shape in slots.items()}

    policied._fmtkit_rules = rules  # type: ignore[attr-defined]
    policied.init_fp8_state = init_fp8_state  # type: ignore[attr-defined]
    return policied
