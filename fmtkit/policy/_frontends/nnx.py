"""Flax NNX adapter: a policied copy of an ``nnx.Module`` graph that shares its Variables.

``wrap(model, rules)`` returns ``nnx.clone(model, variables=False)`` (new Module objects, the
same Variables: training the copy trains the original; the state layout is unchanged) whose
root class is swapped for a subclass (``isinstance`` holds) whose methods run under the
rules (each method closes over them: nothing is looked up on the class). The user's
model is never changed: a Param its rule stores narrower (f32 under pure-bf16) is a converted
copy held by the policied model only (tied Params stay tied), so trying a preset and going
back leaves the original's weights bit-identical; a Param narrower than its rule's
``param_dtype`` (a bf16 model under a mixed preset) raises, as linen and functions do. Each
public method of the root (``__call__``, ``attend``, ...):

1. splits the model and any graph nodes among the arguments (an ``nnx.Rngs``) into
   parameters and other state;
2. traces a pure function that merges them, swaps the merged copy's module classes for
   subclasses whose methods enter the module's registry scope (``scopes``), calls it, and
   returns the output and the new state (BatchNorm statistics, RNG counts, sown values);
3. re-interprets that trace under the rules and writes the new state back (``nnx.update``).

The class swap touches only the traced copy, so the user's modules, graphdefs and pickles are
unchanged. Module paths are the model's own (``blocks/0/mlp/linear1``); layers stacked with
``nnx.vmap`` and run with ``nnx.scan`` are one module (``layers``) whose per-layer state gets a
leading layer axis.

Layers run outside the model's graph have no scope of their own, so their matmuls belong to
the module whose method runs them: a temporary ``nnx.Linear``/``nnx.Conv`` built in
``__call__``, ``nnx.merge`` of a graphdef kept from ``__init__`` (their classes were never
swapped). ``nnx.split``/``nnx.merge``, ``nnx.clone`` and ``nnx.call`` of one of the traced
copy's modules keep its swapped class, so a weight-standardized ``self.conv`` runs at
``.../conv``. Either way rules (path and ``subtree:`` patterns) and ``inspect_policy`` reach
them (linen's detached ``Module.apply`` is placed under its caller likewise, ``linen``).

Delayed FP8 state: a ``DelayedScalingVariable`` ``fp8_state`` on the policied root holding
one amax history per FP8 matmul (created zero at the first call). It works in the functional
style too (``nnx.split(model, nnx.Param, DelayedScalingVariable, ...)``, ``nnx.merge`` inside
the loss):
differentiated with the params, its gradient holds the observed amaxes; not differentiated,
the histories are read and simply not updated that step. Limitation: ``pickle`` of a
graphdef holding the swapped root class fails (it is created at run time).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from fmtkit.policy._engine import caches, runner, scopes, trace
from fmtkit.policy._plan import Plan, resolve_rules
from fmtkit.policy._policy import Rules, is_floating, is_identity


class DelayedScalingVariable(nnx.Variable):
    """The NNX Variable holding a policied NNX model's delayed FP8 scaling states: the amax
    histories of its delayed FP8 matmuls (a dict of f32[..., 3, history], one
    ``fmtkit.DelayedScalingState`` history per matmul), at the policied root's ``fp8_state``.

    Never a ``nnx.Param``: differentiate with respect to it too
    (``nnx.DiffState(0, (nnx.Param, DelayedScalingVariable))``); its "gradient" holds the
    observed amaxes; record them with ``fmtkit.fp8.update_state`` and ``nnx.update`` once per
    step, and keep it out of the optimizer. (Formerly ``Fp8State``, a deprecated alias.)
    """


def type_names(cls: type) -> tuple[str, ...]:
    cls = vars(cls).get("_fmtkit_base", cls)
    return tuple(c.__name__ for c in cls.__mro__
                 if isinstance(c, type) and issubclass(c, nnx.Module) and c is not nnx.Module)


_BASE_NAMES = frozenset(dir(nnx.Module))


def _method_names(cls: type) -> tuple[str, ...]:
    """``__call__`` plus public methods defined by user classes or Flax's layers."""
    names: list[str] = []
    for klass in cls.__mro__:
        if klass is nnx.Module or not (isinstance(klass, type) and issubclass(klass, nnx.Module)):
            break
        for name, value in vars(klass).items():
            if name in names or not callable(value) or isinstance(value, type):
                continue
            if name == "__call__" or (not name.startswith("_") and name not in _BASE_NAMES):
                names.append(name)
    return tuple(names)


def _scoped_method(cls: type, name: str, path: str, names: tuple[str, ...]):
    """``cls``'s method ``name`` in the module's scope; the method is looked up at each call,
    as a subclass's inherited method is (one redefined on ``cls`` later is the one run)."""
    @functools.wraps(getattr(cls, name))
    def method(self, *args, **kwargs):
        with scopes.module_scope(path, names):
            return getattr(cls, name)(self, *args, **kwargs)

    return method


@functools.cache
def _scoped_class(cls: type, path: str) -> type:
    # A policied sub-module run as its own region (``_policied_method``) is scoped again at
    # its own root: scope the class its parent's trace swapped, not that scoped class.
    cls = vars(cls).get("_fmtkit_unscoped", cls)
    names = type_names(cls)
    namespace = {n: _scoped_method(cls, n, path, names) for n in _method_names(cls)}
    namespace.update(__module__=cls.__module__, __qualname__=cls.__qualname__,
                     _fmtkit_base=cls, _fmtkit_unscoped=cls, _fmtkit_path=path)
    return type(cls.__name__, (cls,), namespace)


@contextlib.contextmanager
def _scoped_modules(model: nnx.Module):
    """Swaps the classes of ``model``'s modules (a traced copy) for scoped subclasses."""
    swapped = []
    for parts, module in nnx.iter_modules(model):
        path = "/".join(str(p) for p in parts)
        swapped.append((module, type(module)))
        module.__class__ = _scoped_class(type(module), path)
    try:
        yield
    finally:
        for module, cls in swapped:
            module.__class__ = cls


def collect_paths(model: nnx.Module, *example_inputs: Any, **kwargs: Any
                  ) -> dict[str, tuple[str, ...]]:
    """Paths and class names of every module of the graph (no inputs needed)."""
    if example_inputs or kwargs:
        raise TypeError("module_paths of an NNX model takes no example inputs: its modules "
                        "are known from the graph.")
    out = {}
    for parts, module in nnx.iter_modules(model):
        out["/".join(str(p) for p in parts)] = type_names(type(module))
    # iter_modules is post-order (root last); list the root first, then in path order.
    return dict(sorted(out.items(), key=lambda kv: (kv[0] != "", kv[0].split("/"))))


def _store_params(copy: nnx.Module, plan: Plan) -> None:
    """Gives the policied copy its own Params where its rule stores a narrower dtype.

    A Param wider than its module's ``param_dtype`` (f32 under pure-bf16) is replaced, in the
    copy only, by a converted Variable (one per Variable, so tied parameters stay tied); every
    other Param stays shared with the user's model, which is never changed.
    """
    memo: dict[int, nnx.Variable] = {}
    for parts, module in list(nnx.iter_modules(copy)):
        path = "/".join(str(p) for p in parts)
        policy = plan.policy(path, type_names(type(module)))
        if policy is None:
            continue
        want = np.dtype(policy.param_dtype)
        for name, value in list(vars(module).items()):
            if not isinstance(value, nnx.Param):
                continue
            raw = value.get_value()
            if is_floating(raw) and raw.dtype != want and raw.dtype.itemsize > want.itemsize:
                if id(value) not in memo:
                    memo[id(value)] = value.replace(raw.astype(want))
                setattr(module, name, memo[id(value)])


def _param_leaves(params: Any) -> list[tuple[tuple, Any]]:
    """``(key names, value)`` of the model's Params (node 0 of the split state), for
    ``resolve_rules``'s parameter check."""
    return [(path[1:], var.get_value()) for path, var in nnx.to_flat_state(params)
            if path and path[0] == 0]


_PARAMS = "the model's nnx.Param"  # how the parameter check names them


def _is_param(path, leaf) -> bool:
    # trace((params, rest, args, kwargs), {}): path[1] is the params state's index 0.
    return len(path) > 1 and getattr(path[1], "idx", None) == 0


@dataclasses.dataclass(frozen=True)
class Setup:
    """What ``with_policy`` was given for an NNX model: the rules and whether traces are
    kept. The policied root's methods close over it and resolve it against the model's
    modules at each call (``_policied_call``)."""

    rules: Rules
    cache_traces: bool = True


def _policied_call(setup: Setup, model: nnx.Module, fn, args: tuple, kwargs: dict,
                   nested: bool = False) -> Any:
    """``fn(model, *args, **kwargs)`` traced and re-interpreted under ``setup``'s rules,
    resolved against the model's modules (the plan the engine runs); ``nested``: called
    inside another policied model's trace (``runner.run``)."""
    nodes_in = [x for x in jax.tree.leaves((args, kwargs), is_leaf=nnx.graph.is_graph_node)
                if nnx.graph.is_graph_node(x)]
    graphdef, params, rest = nnx.split((model, *nodes_in), nnx.Param, ...)
    plan = resolve_rules(setup.rules, collect_paths(model), params=_param_leaves(params),
                         what=_PARAMS)
    a_tree, k_tree = jax.tree.map(lambda x: _SLOT if nnx.graph.is_graph_node(x) else x,
                                  (args, kwargs), is_leaf=nnx.graph.is_graph_node)

    def pure(p, r, a, k):
        merged, *nodes = nnx.merge(graphdef, p, r)
        it = iter(nodes)
        a, k = jax.tree.map(lambda x: next(it) if isinstance(x, _Slot) else x, (a, k),
                            is_leaf=lambda x: isinstance(x, _Slot))
        with _scoped_modules(merged):
            out = fn(merged, *a, **k)
        _, new_state = nnx.split((merged, *nodes))
        return out, new_state

    def run(tree):
        traced = trace.trace(pure, tree, {}, is_param=_is_param,
                              cache=caches.NNX_TRACES if setup.cache_traces else None,
                              cache_key=(graphdef, fn), static_types=(_Slot,))
        (out, new_state), _ = runner.run(traced, plan, main=_main_outputs(traced),
                                          fp8_state=_fp8_state(model, traced, plan, nested),
                                          nested=nested)
        return out, new_state

    def changes(tree):  # the output and the Variables the call changed or created
        out, new_state = run(tree)
        before = _values(tree[:2])
        changed = [(path, var) for path, var in nnx.to_flat_state(new_state)
                   if not (path in before and _same(before[path], var.get_value()))]
        return (out, [var.get_value() for _, var in changed]), [(p, type(v)) for p, v in changed]

    tree = (params, rest, a_tree, k_tree)
    # Eager calls: compiled once per signature (caches.EagerCache; the graphdef and the
    # method are part of the key). Not under a delayed FP8 recipe: its histories are read
    # from the model itself.
    delayed = plan.delayed or isinstance(vars(model).get("fp8_state"), DelayedScalingVariable)
    cached, result = ((False, None) if delayed or nested or is_identity(plan.rules) else
                      caches.NNX_EAGER_CALLS(changes, tree, (graphdef, fn), static_types=(_Slot,),
                                   aux=True))
    if not cached:
        (out, values), kinds = changes(tree)
    else:
        (out, values), kinds = result
    _write_back((model, *nodes_in), [(path, kind, value) for (path, kind), value
                                     in zip(kinds, values)])
    return out


def _values(states) -> dict:
    return {path: var.get_value() for state in states for path, var in nnx.to_flat_state(state)}


def _main_outputs(traced) -> list[bool | str]:
    """Per output leaf of ``pure``: True for the method's output, the sowing module's path
    for a value the model sowed (``nnx.Intermediate``: read as that module sees it, as linen
    does), False for other state (BatchNorm statistics, RNG counts)."""
    out_shapes, state = jax.tree.unflatten(traced.out_tree, traced.out_avals)
    kinds = {tuple(path): type(var) for path, var in nnx.to_flat_state(state)}
    main: list[bool | str] = [True] * len(jax.tree.leaves(out_shapes))
    for path, _ in jax.tree_util.tree_leaves_with_path(state):
        keys = []
        for k in path:  # (node index, *module path, name) then the Variable's own keys
            if not isinstance(k, jax.tree_util.DictKey):
                break
            keys.append(k.key)
        sown = keys and keys[0] == 0 and issubclass(kinds.get(tuple(keys), object),
                                                    nnx.Intermediate)
        main.append("/".join(str(k) for k in keys[1:-1]) if sown else False)
    return main


def _fp8_state(model: nnx.Module, traced, plan: Plan, nested: bool = False) -> dict | None:
    """The delayed-FP8 histories of the model (created zero at the first call, which cannot
    be a call inside another policied model's trace: the Variable would hold its tracers)."""
    state = vars(model).get("fp8_state")
    if isinstance(state, DelayedScalingVariable):
        return dict(state.get_value())
    if not plan.delayed:
        return None
    shapes = jax.tree.unflatten(traced.out_tree, traced.out_avals)
    n_main = len(jax.tree.leaves(shapes[0]))
    slots = runner.fp8_slots(traced, plan, [i < n_main for i in range(len(traced.out_avals))],
                              nested=nested)
    if not slots:
        return None
    if nested:
        raise ValueError(
            "This policied NNX model has a delayed FP8 recipe and is called inside another "
            "policied model before it has its amax histories (fp8_state), which cannot be "
            "created inside that model's trace. Call it once on its own first, or make "
            "the region a function of it: with_policy(lambda m, x: m(x), ...) with "
            "fp8_state=... (init_fp8_state).")
    fresh = {k: jnp.zeros(shape, jnp.float32) for k, shape in slots.items()}
    model.fp8_state = DelayedScalingVariable(fresh)
    return fresh


def _write_back(nodes: tuple, changed: list) -> None:
    """Sets the Variables whose value the call changed (BatchNorm statistics, RNG counts) and
    creates those it made (``sow``), from ``(path, Variable type, value)``; unchanged ones
    are not touched, so a model closed over by a JAX transform is never written from inside
    it."""
    if not changed:
        return
    graph = dict(nnx.iter_graph(nodes))
    for path, kind, value in changed:
        target = graph.get(path)
        if isinstance(target, nnx.Variable):
            target.set_value(value)
        else:
            setattr(graph[path[:-1]], path[-1], kind(value))


def _same(a: Any, b: Any) -> bool:
    """Whether two Variable values hold the same leaf objects (a ``DelayedScalingVariable``
    value is a dict, rebuilt by the trace even when no history changed)."""
    la, ta = jax.tree.flatten(a)
    lb, tb = jax.tree.flatten(b)
    return ta == tb and all(x is y for x, y in zip(la, lb))


class _Slot:
    """Where a graph node stood among the call arguments (filled back inside the trace)."""


_SLOT = _Slot()  # one instance: a static leaf of the eager cache's key


def _policied_method(fn, setup: Setup):
    @functools.wraps(fn)
    def method(self, *args, **kwargs):
        if not scopes.is_tracing():
            return _policied_call(setup, self, fn, args, kwargs)
        if vars(type(self)).get("_fmtkit_path") == "":  # the root of its own trace
            return fn(self, *args, **kwargs)
        # Called inside another policied model's trace (by a function, or as a sub-module):
        # a nested region, as a policied function is (``functions.wrap``): its rules
        # decide its ops, no head by role.
        scopes.note_nested_call()
        with jax.named_scope(scopes.NESTED_SCOPE):
            return _policied_call(setup, self, fn, args, kwargs, nested=True)

    return method


# The policied root classes, one per (model class, setup): a policied model's graphdef
# holds its class, so equal setups give equal graphdefs (the trace and eager caches' keys).
_ROOT_CLASSES: dict[tuple[type, Setup], type] = {}


def _policied_class(cls: type, setup: Setup) -> type:
    key = (cls, setup)
    if key not in _ROOT_CLASSES:
        namespace = {n: _policied_method(getattr(cls, n), setup) for n in _method_names(cls)}
        namespace.update(__module__=cls.__module__, __qualname__=cls.__qualname__,
                         __doc__=cls.__doc__, _fmtkit_base=cls)
        _ROOT_CLASSES[key] = type(cls.__name__, (cls,), namespace)
    return _ROOT_CLASSES[key]


def is_wrapped(obj: Any) -> bool:
    return isinstance(obj, nnx.Module) and type(obj) in _ROOT_CLASSES.values()


def wrap(model: nnx.Module, rules: Rules, *, strict: bool, cache_traces: bool = True,
         params_argnums: Any = None) -> nnx.Module:
    """A copy of ``model``'s module graph whose root runs under ``rules``; it shares the
    model's Variables except the Params its rules store narrower (converted copies), so the
    user's model is never changed. Params narrower than their rule's ``param_dtype`` raise
    (``fmtkit.policy._plan.resolve_rules``)."""
    if is_wrapped(model):
        raise ValueError("This NNX model already has a policy (with_policy was applied to it); "
                         "apply with_policy once, to the unwrapped model, with all rules.")
    plan = resolve_rules(rules, collect_paths(model), strict=strict,
                         params=_param_leaves(nnx.split((model,), nnx.Param, ...)[1]), what=_PARAMS)
    copy = nnx.clone(model, variables=False)
    _store_params(copy, plan)
    copy.__class__ = _policied_class(type(model), Setup(rules, cache_traces))
    return copy
