"""``inspect_policy``: what dtypes a (policied) model really computes in, read from the jaxpr."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

import jax
import jax.extend.core as jex
import jax.numpy as jnp

from fmtkit.policy import _runtime
from fmtkit.policy._apply import flax_kind
from fmtkit.policy._policy import Policy, Rules, _is_floating

__all__ = ["ModuleReport", "PolicyReport", "inspect_policy"]

OUTSIDE = "<outside>"
_MODULE_RX = re.compile(re.escape(_runtime.SCOPE_PREFIX) + r"(\d+)")
_ROUND_RX = re.compile(re.escape(_runtime.GRAD_SCOPE) + r"([a-z0-9]+)")


@dataclasses.dataclass(frozen=True)
class ModuleReport:
    """What one module computed, from the jaxpr of ``value_and_grad(loss)``.

    Only the module's own operations count (a child module's are in the child's report).

    Attributes:
      path: the module path (``"<outside>"``: code outside every module, e.g. the loss).
      type_name: the module's class name.
      policy: the Policy the rules gave it (None: untouched).
      input_dtypes, output_dtypes: dtypes of its floating inputs (after the input cast) and
        outputs (after the output cast).
      dots: its forward ``dot_general``s as ``"lhs x rhs -> out"`` dtype strings.
      grad_dots: the backward ``dot_general``s attributed to it.
      ops: forward primitive name -> dtypes of its results (e.g. ``exp``, ``rsqrt``).
      grad_ops: the same for the backward pass.
      grad_roundings: dtypes its incoming cotangents were rounded through (``grad_dtype``).
      params: parameter name -> ``(stored dtype, gradient dtype)``.
    """

    path: str
    type_name: str
    policy: Policy | None
    input_dtypes: tuple[str, ...]
    output_dtypes: tuple[str, ...]
    dots: tuple[str, ...]
    grad_dots: tuple[str, ...]
    ops: Mapping[str, tuple[str, ...]]
    grad_ops: Mapping[str, tuple[str, ...]]
    grad_roundings: tuple[str, ...]
    params: Mapping[str, tuple[str, str]]

    @property
    def compute_dtypes(self) -> tuple[str, ...]:
        """Operand dtypes of the module's forward matmuls."""
        out = set()
        for d in self.dots:
            lhs, rhs = d.split(" -> ")[0].split(" x ")
            out |= {lhs, rhs}
        return tuple(sorted(out))


@dataclasses.dataclass(frozen=True)
class PolicyReport:
    """Per-module dtypes of one forward + backward pass (``inspect_policy``'s result).

    Attributes:
      modules: path -> ``ModuleReport``, in call order; ``"<outside>"`` (the loss) last.
      params: full parameter path (``"Block_0/Dense_0/kernel"``) -> (stored, gradient) dtype.
      output_dtypes: dtypes of the model's floating outputs.
      loss_dtype: dtype of the loss.
    """

    modules: Mapping[str, ModuleReport]
    params: Mapping[str, tuple[str, str]]
    output_dtypes: tuple[str, ...]
    loss_dtype: str

    def dots(self, *, backward: bool = False) -> list[tuple[str, str]]:
        """All ``(module path, dot)`` pairs of the forward (or backward) pass."""
        return [(path, d) for path, m in self.modules.items()
                for d in (m.grad_dots if backward else m.dots)]

    def __str__(self) -> str:
        lines = [f"{'module':<40} {'policy':<26} {'matmul operands':<22} outputs"]
        for path, m in self.modules.items():
            pol = str(m.policy) if m.policy else "-"
            comp = ",".join(m.compute_dtypes) or "-"
            lines.append(f"{path or '(model)':<40} {pol:<26} {comp:<22} "
                         f"{','.join(m.output_dtypes) or '-'}")
            for name, (stored, grad) in m.params.items():
                lines.append(f"{'':<4}{name}: stored {stored}, grad {grad}")
        lines.append(f"outputs: {','.join(self.output_dtypes)}; loss: {self.loss_dtype}")
        return "\n".join(lines)


def _dtype(v) -> str:
    return str(v.aval.dtype) if hasattr(v.aval, "dtype") else "-"


def _walk(jaxpr, prefix: str, visit: Callable) -> None:
    for eqn in jaxpr.eqns:
        stack = str(eqn.source_info.name_stack)
        full = f"{prefix}/{stack}" if prefix and stack else (prefix or stack)
        visit(eqn, full)
        for sub in jex.jaxprs_in_params(eqn.params):
            _walk(sub, full, visit)


def _key_str(entry) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(entry, attr):
            return str(getattr(entry, attr))
    return str(entry)


def _param_table(params, grads) -> dict[str, tuple[str, str]]:
    flat_p = jax.tree_util.tree_flatten_with_path(params)[0]
    flat_g = jax.tree.leaves(grads)
    out = {}
    for (path, p), g in zip(flat_p, flat_g):
        parts = [_key_str(k) for k in path]
        while parts and parts[-1] in ("value", "raw_value", "_raw_value"):
            parts.pop()
        out["/".join(parts)] = (str(p.dtype), str(g.dtype))
    return out


def _default_loss(out) -> jax.Array:
    leaves = [x for x in jax.tree.leaves(out) if _is_floating(x)]
    if not leaves:
        raise ValueError("The model returned no floating output; pass loss_fn.")
    total = jnp.sum(leaves[0].astype(jnp.float32))
    for x in leaves[1:]:
        total = total + jnp.sum(x.astype(jnp.float32))
    return total


def inspect_policy(model: Any, *inputs: Any, variables: Any = None,
                   loss_fn: Callable[[Any], jax.Array] | None = None,
                   **kwargs: Any) -> PolicyReport:
    """Reports the dtypes a model actually computes in, per module, from the jaxpr.

    Traces (never runs) ``jax.value_and_grad(lambda params: loss_fn(model(*inputs)))`` and
    attributes each equation to the innermost module whose call produced it. Works on a model
    returned by ``with_policy`` and on an unwrapped one (to compare).

    Args:
      model: a linen or NNX model, wrapped by ``with_policy`` or not.
      *inputs: example inputs (arrays or ``jax.ShapeDtypeStruct``).
      variables: linen only: the variables (default: ``jax.eval_shape`` of ``init``, so no
        memory is used). Gradients are taken with respect to ``variables["params"]``.
      loss_fn: maps the model's output to a scalar (default: the f32 sum of its floating
        outputs).
      **kwargs: keyword arguments of the model call.

    Returns:
      A ``PolicyReport``; ``print`` it for a table.

    Example:
      >>> import jax.numpy as jnp, flax.linen as nn
      >>> from fmtkit.policy import with_policy
      >>> report = inspect_policy(with_policy(nn.Dense(4), "bf16-mixed"), jnp.ones((2, 3)))
      >>> report.modules[""].dots, report.params["kernel"]
      (('bfloat16 x bfloat16 -> bfloat16',), ('float32', 'float32'))
    """
    kind = flax_kind(model)
    loss_fn = loss_fn or _default_loss
    if kind == "linen":
        from fmtkit.policy import _linen

        wrapped = model if isinstance(model, _linen.PolicyModule) else _linen.PolicyModule(
            inner=model, rules=Rules())
        if variables is None:
            keys = {"params": jax.random.key(0), "dropout": jax.random.key(1)}
            variables = jax.eval_shape(lambda ins: wrapped.init(keys, *ins, **kwargs), inputs)
        params = variables["params"]
        rest = {k: v for k, v in variables.items() if k != "params"}

        def f(params, ins):
            out = wrapped.apply({**rest, "params": params}, *ins, **kwargs)
            return loss_fn(out), out
    else:
        from flax import nnx

        from fmtkit.policy import _nnx

        if variables is not None:
            raise TypeError("variables is for linen models; an NNX model holds its own.")
        wrapped = model if _nnx.is_wrapped(model) else _nnx.wrap(model, Rules(), False)
        graphdef, params, rest = nnx.split(wrapped, nnx.Param, ...)

        def f(params, ins):
            out = nnx.merge(graphdef, params, rest)(*ins, **kwargs)
            return loss_fn(out), out

    with _runtime.recording() as rec:
        closed, shapes = jax.make_jaxpr(jax.value_and_grad(f, has_aux=True),
                                        return_shape=True)(params, inputs)
    (loss_shape, out_shapes), grad_shapes = shapes
    return _assemble(closed, rec, _param_table(params, grad_shapes), out_shapes, loss_shape)


def _assemble(closed, rec: _runtime.Recorder, param_table, out_shapes, loss_shape) -> PolicyReport:
    n = len(rec.records)
    acc = [dict(dots=[], grad_dots=[], ops={}, grad_ops={}, rounds=set()) for _ in range(n + 1)]

    def visit(eqn, stack: str):
        found = _MODULE_RX.findall(stack)
        a = acc[int(found[-1])] if found else acc[n]
        backward = "transpose(" in stack
        name = eqn.primitive.name
        if name == "dot_general":
            d = (f"{_dtype(eqn.invars[0])} x {_dtype(eqn.invars[1])} -> "
                 f"{_dtype(eqn.outvars[0])}")
            lst = a["grad_dots" if backward else "dots"]
            if d not in lst:
                lst.append(d)
        if not list(jex.jaxprs_in_params(eqn.params)):
            ops = a["grad_ops" if backward else "ops"]
            ops.setdefault(name, set()).update(_dtype(v) for v in eqn.outvars)
        if backward and name == "convert_element_type":
            ms = list(_ROUND_RX.finditer(stack))
            m = ms[-1] if ms else None
            if m and m.start() > stack.rfind(_runtime.SCOPE_PREFIX):
                a["rounds"].add(m.group(1))

    _walk(closed.jaxpr, "", visit)

    def frozen(d):
        return MappingProxyType({k: tuple(sorted(v)) for k, v in sorted(d.items())})

    modules = {}
    for i, r in enumerate([*rec.records, None]):
        a = acc[i]
        path = r.path if r else OUTSIDE
        prefix = f"{path}/" if path else ""
        own = {}
        if r is not None:
            for full, dt in param_table.items():
                if full.startswith(prefix) and "/" not in full[len(prefix):]:
                    own[full[len(prefix):]] = dt
        rounds = sorted(a["rounds"])
        modules[path] = ModuleReport(
            path=path, type_name=r.type_name if r else "-", policy=r.policy if r else None,
            input_dtypes=tuple(sorted(r.input_dtypes)) if r else (),
            output_dtypes=tuple(sorted(r.output_dtypes)) if r else (),
            dots=tuple(a["dots"]), grad_dots=tuple(a["grad_dots"]), ops=frozen(a["ops"]),
            grad_ops=frozen(a["grad_ops"]), grad_roundings=tuple(rounds),
            params=MappingProxyType(own))
    out_dtypes = tuple(sorted({str(s.dtype) for s in jax.tree.leaves(out_shapes)
                               if jnp.issubdtype(s.dtype, jnp.floating)}))
    return PolicyReport(modules=MappingProxyType(modules), params=MappingProxyType(param_table),
                        output_dtypes=out_dtypes, loss_dtype=str(loss_shape.dtype))
