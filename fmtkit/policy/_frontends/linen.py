"""Flax linen adapter: ``PolicyModel`` runs an unmodified linen module under ``Rules``.

``init`` is the module's own ``init`` (parameters then stored in each module's
``param_dtype``, plus an ``"fp8_state"`` collection of amax histories when a delayed FP8 recipe
applies); ``apply`` traces the module's own ``apply`` with ``nn.intercept_methods`` naming
each module call's scope, and re-interprets the trace under the rules (``_engine.runner``). The
interceptor is entered inside the traced function, so ``jax.jit(policied.apply)`` holds the
policy (linen's interceptor stack is not part of jit's cache key).
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from fmtkit.policy._engine import caches, runner, scopes, trace
from fmtkit.policy._plan import Plan, resolve_rules
from fmtkit.policy._policy import Rules, cast_floating, is_identity

FP8_COLLECTION = "fp8_state"


def type_names(cls: type) -> tuple[str, ...]:
    """Class names from ``cls`` up to (excluding) ``nn.Module``, most derived first."""
    return tuple(c.__name__ for c in cls.__mro__
                 if isinstance(c, type) and issubclass(c, nn.Module) and c is not nn.Module)


def module_path(module: nn.Module) -> str:
    return "/".join(str(p) for p in module.path)


def _scope_interceptor(next_fun, args, kwargs, context):
    """Wraps each public method call of a module in its registry scope.

    Lifted-transform wrappers (``nn.scan``/``nn.remat``/``nn.vmap``: method ``'<lambda>'``)
    and ``setup`` pass through; their bodies' modules are scoped as ordinary modules, with
    paths that have no layer index (``blocks/mlp``).
    """
    name = context.method_name
    if name in ("<lambda>", "setup") or (name.startswith("_") and name != "__call__"):
        return next_fun(*args, **kwargs)
    module = context.module
    path, prefix = _full_path(module)
    _CALLS.stack.append((path, _root_of(module), prefix))
    try:
        with scopes.module_scope(path, type_names(type(module))):
            return next_fun(*args, **kwargs)
    finally:
        _CALLS.stack.pop()


class _Calls(threading.local):
    """The module calls being intercepted on this thread, outermost first: (full path, the
    variable scope root the module belongs to, the prefix of that root's paths)."""

    def __init__(self):
        self.stack: list[tuple[str, Any, str]] = []


_CALLS = _Calls()


def _root_of(module: nn.Module) -> Any:
    return None if module.scope is None else module.scope.root


def _full_path(module: nn.Module) -> tuple[str, str]:
    """The module's path in the model being traced, and the prefix of its apply's paths.

    A module run by a detached ``Module.apply`` inside another module's call (a tied output
    head ``nn.Dense(V, name="lm_head").apply({"params": {"kernel": emb.T}}, h)``, a
    weight-standardized conv) has a path relative to its own apply's root; it is placed
    under the calling module, named by its name (else its class), e.g. ``"decoder/lm_head"``,
    so rules and ``inspect_policy`` reach it; its own submodules follow it."""
    own = module_path(module)
    root = _root_of(module)
    for _, r, prefix in reversed(_CALLS.stack):
        if r is root:  # the same apply as an enclosing call's
            return "/".join(p for p in (prefix, own) if p), prefix
    if not _CALLS.stack:  # the model itself
        return own, ""
    caller = _CALLS.stack[-1][0]
    prefix = caller if module.path else "/".join(
        p for p in (caller, module.name or type(module).__name__) if p)
    return "/".join(p for p in (prefix, own) if p), prefix


def scoped():
    """The interceptor that names linen module scopes (for traces of plain functions too)."""
    return nn.intercept_methods(_scope_interceptor)


def _is_param(path, leaf) -> bool:
    # trace((variables, rngs, args, kwargs), {}): path[1] is the variables' index 0.
    return (len(path) > 2 and getattr(path[1], "idx", None) == 0
            and getattr(path[2], "key", None) == "params")


@dataclasses.dataclass(frozen=True, eq=False)
class PolicyModel:
    """A linen model under a precision policy; made by ``with_policy``.

    ``init`` and ``apply`` take the arguments of ``nn.Module.init`` / ``apply``; the variables
    are the inner model's (parameters in each module's ``param_dtype``), plus
    ``"fp8_state"`` (amax histories, f32[..., 3, history]) when a delayed FP8 recipe applies:
    pass it to ``apply`` with the rest, differentiate the loss with respect to it as well,
    and record the observed amaxes with ``fmtkit.fp8.update_state(state, grads_of_state)``.
    ``apply`` raises when a parameter is narrower than its module's ``param_dtype`` (a bf16
    checkpoint under a mixed preset): it never converts the parameters it is given.

    Not itself an ``nn.Module`` (the policy transforms the whole traced ``inner.apply`` as a
    pure function of its variables, as ``jax.jit`` transforms a function); ``as_module()``
    gives the ``nn.Module`` that runs it inside a parent (nested, ``nn.tabulate``, ``bind``).

    Attributes:
      inner: the unmodified model.
      rules: the policy rules.
      strict: raise (instead of warning) when a rule pattern matches no module.
      cache_traces: keep the model's trace per input signature (``caches.TraceCache``): a second
        trace with the same signature (an eval step, a fresh ``jit``) does not run the
        model's Python again.
    """

    inner: nn.Module
    rules: Rules
    strict: bool = False
    cache_traces: bool = True
    _traces: caches.TraceCache = dataclasses.field(
        default_factory=caches.TraceCache, init=False, repr=False, compare=False)
    _eager_calls: caches.EagerCache = dataclasses.field(default_factory=caches.EagerCache,
                                                        init=False, repr=False,
                                                        compare=False)

    def init(self, rngs: Any, *args: Any, method: Any = None, **kwargs: Any) -> dict:
        """``inner.init`` with parameters stored per rule and the FP8 state added."""
        registry = scopes.Registry()
        with scopes.tracing(registry), scoped():
            variables = self.inner.init(rngs, *args, method=method, **kwargs)
        plan = resolve_rules(self.rules, registry.visited(), strict=self.strict)
        variables = dict(variables)
        variables["params"] = self._store(variables.get("params", {}), plan)
        if plan.delayed:
            # Every collection mutable (BatchNorm in training mode updates its statistics) and
            # a "dropout" stream (dropout in training mode): only shapes are read here.
            keys = dict(rngs) if isinstance(rngs, Mapping) else {"params": rngs}
            keys.setdefault("dropout", next(iter(keys.values())))
            traced = self._trace(variables, keys, args, kwargs, method, True)
            slots = runner.fp8_slots(traced, resolve_rules(self.rules, traced.modules),
                                      _main_outputs(traced, True))
            if slots:
                variables[FP8_COLLECTION] = {k: jnp.zeros(shape, jnp.float32)
                                             for k, shape in slots.items()}
        return variables

    def _store(self, params: Any, plan: Plan) -> Any:
        """``params`` with each leaf cast to its module's ``param_dtype``."""
        def store(path, leaf):
            names = [str(getattr(k, "key", k)) for k in path]
            policy = plan.policy("/".join(names[:-1]))
            return leaf if policy is None else cast_floating(leaf, policy.param_dtype)

        return jax.tree_util.tree_map_with_path(store, params)

    def _trace(self, variables, rngs, args, kwargs, method, mutable):
        def fn(v, r, a, k):
            with scoped():
                return self.inner.apply(v, *a, rngs=r, method=method, mutable=mutable, **k)

        mutable_key = tuple(mutable) if isinstance(mutable, list) else mutable
        return trace.trace(fn, (variables, rngs, args, kwargs), {}, is_param=_is_param,
                            cache=self._traces if self.cache_traces else None,
                            cache_key=(self.inner, method, mutable_key))

    def as_module(self, **module_kwargs: Any) -> nn.Module:
        """This policied model as an ``nn.Module`` (``PolicyModule``; ``name=`` etc. go to
        it): nested in a parent module, ``nn.tabulate``-d or ``bind``-ed.

        Example:
          >>> import jax, jax.numpy as jnp, flax.linen as nn
          >>> from fmtkit.policy import with_policy
          >>> class Parent(nn.Module):
          ...     @nn.compact
          ...     def __call__(self, x):
          ...         mlp = with_policy(nn.Dense(4), "bf16-mixed").as_module(name="mlp")
          ...         return mlp(nn.Dense(3)(x))
          >>> v = Parent().init(jax.random.key(0), jnp.ones((2, 5)))
          >>> jax.tree.map(jnp.shape, v["params"]["mlp"])
          {'bias': (4,), 'kernel': (3, 4)}
        """
        return PolicyModule(self, **module_kwargs)

    def apply(self, variables: Any, *args: Any, rngs: Any = None, method: Any = None,
              mutable: Any = False, **kwargs: Any) -> Any:
        """``inner.apply`` under the rules (same arguments and results).

        Called eagerly (outside ``jax.jit``/``jax.grad``), the policied apply is compiled once
        per input signature and reused: a second call neither re-traces nor
        re-interprets the model (``caches.EagerCache``).
        """
        def call(tree):
            v, r, a, k = tree
            return self._apply(v, *a, rngs=r, method=method, mutable=mutable, **k)

        if is_identity(self.rules):  # "fp32": op by op, as the unwrapped apply runs
            return call((variables, rngs, args, kwargs))
        mutable_key = tuple(mutable) if isinstance(mutable, list) else mutable
        cached, out = self._eager_calls(call, (variables, rngs, args, kwargs),
                                        (method, mutable_key))
        return out if cached else call((variables, rngs, args, kwargs))

    def _apply(self, variables: Any, *args: Any, rngs: Any = None, method: Any = None,
               mutable: Any = False, **kwargs: Any) -> Any:
        variables = dict(variables)
        fp8_state = variables.pop(FP8_COLLECTION, None)
        traced = self._trace(variables, rngs, args, kwargs, method, mutable)
        leaves = [(tuple(str(getattr(k, "key", k)) for k in path), leaf) for path, leaf
                  in jax.tree_util.tree_leaves_with_path(variables.get("params", {}))]
        plan = resolve_rules(self.rules, traced.modules, strict=self.strict, params=leaves,
                             what="variables['params']")
        # Applied inside another policied model's trace: a nested region, as a policied
        # function is (``functions.wrap``): its rules decide its ops, no head by role.
        nested = scopes.is_tracing()
        if nested:
            scopes.note_nested_call()
        with jax.named_scope(scopes.NESTED_SCOPE) if nested else contextlib.nullcontext():
            out, _ = runner.run(traced, plan, main=_main_outputs(traced, mutable),
                                 fp8_state=None if fp8_state is None else dict(fp8_state),
                                 nested=nested)
        return out


class PolicyModule(nn.Module):
    """A ``PolicyModel`` as an ``nn.Module``: nest it in a parent, ``nn.tabulate`` it, ``bind``.

    Its variables live in its own scope, laid out as the policied model's (``params`` as the
    inner model's tree, ``fp8_state`` under a delayed FP8 recipe); ``__call__`` runs
    ``PolicyModel.apply`` on them as a pure function, so the sub-model computes exactly what
    it computes on its own (its outputs are the "model outputs" its head is found from).
    Streams the parent was given (``rngs``) and its mutable collections reach the sub-model.

    Attributes:
      policied: the ``PolicyModel`` (``with_policy(model, ...)``).
    """

    policied: PolicyModel

    @nn.compact
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        pm = self.policied  # init/apply run the inner model unbound, as on its own
        streams = list(self.scope.rngs)
        if self.is_initializing():
            created = pm.init({n: self.make_rng(n) for n in streams}, *args, **kwargs)
            for col, tree in created.items():
                for name, value in tree.items():
                    self.put_variable(col, name, value)
        variables = {col: dict(tree) for col, tree in self.variables.items()}
        mutable = [c for c in variables if c not in ("params", FP8_COLLECTION)
                   and self.is_mutable_collection(c)]
        rngs = {n: self.make_rng(n) for n in streams if n != "params"} or None
        out = pm.apply(variables, *args, rngs=rngs, mutable=mutable or False, **kwargs)
        if mutable:
            out, updates = out
            for col, tree in updates.items():
                for name, value in tree.items():
                    self.put_variable(col, name, value)
        return out


def _main_outputs(traced, mutable) -> list[bool | str] | None:
    """Per output leaf of ``apply``: True for the model's output, False for an updated
    collection (BatchNorm statistics), the sowing module's path for a sown intermediate
    (read as that module sees it)."""
    if not mutable:
        return None
    shapes = jax.tree.unflatten(traced.out_tree, traced.out_avals)
    flags: list[bool | str] = [True] * len(jax.tree.leaves(shapes[0]))
    for path, _ in jax.tree_util.tree_leaves_with_path(shapes[1]):
        if getattr(path[0], "key", None) == "intermediates":
            # intermediates/<module path>/<name>/<index>: the module is all but the last two.
            keys = [str(k.key) for k in path[1:] if hasattr(k, "key")]
            flags.append("/".join(keys[:-1]))
        else:
            flags.append(False)
    return flags


def collect_paths(model: nn.Module, *example_inputs, **kwargs) -> dict[str, tuple[str, ...]]:
    """Paths and class names of the modules ``model`` calls on ``example_inputs`` (abstract
    init)."""
    inner = model.inner if isinstance(model, PolicyModel) else model
    registry = scopes.Registry()

    def init():
        keys = {"params": jax.random.key(0), "dropout": jax.random.key(1)}
        with scopes.tracing(registry), scoped():
            return inner.init(keys, *example_inputs, **kwargs)

    jax.eval_shape(init)
    return registry.visited()


def wrap(model: nn.Module, rules: Rules, *, strict: bool, cache_traces: bool = True,
         params_argnums: Any = None) -> PolicyModel:
    """``model`` under ``rules`` (``with_policy`` of a linen module)."""
    if is_wrapped(model):
        raise ValueError("This linen model already has a policy (it is a PolicyModel); "
                         "apply with_policy once, to the unwrapped model, with all rules.")
    return PolicyModel(inner=model, rules=rules, strict=strict, cache_traces=cache_traces)


def is_wrapped(obj: Any) -> bool:
    return isinstance(obj, PolicyModel)
