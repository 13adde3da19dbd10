"""``inspect_policy``: what a (policied) model really computes in, per module and op class.

The report is read from the jaxpr of ``jax.value_and_grad`` of the loss, not from the rules:
every interpreted op runs in a named scope ``fmtkit_op_<i>`` that JAX keeps through
differentiation, so each equation of the final jaxpr, forward or backward, is attributed to
the op (and module) it came from.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

import jax
import jax.extend.core as jex
import jax.numpy as jnp

from fmtkit.policy import _interpret, _ops
from fmtkit.policy._apply import flax_kind
from fmtkit.policy._policy import Policy, Rules, is_floating

__all__ = ["ModuleReport", "PolicyReport", "inspect_policy"]

_OP_RX = re.compile(re.escape(_interpret.OP_SCOPE) + r"(\d+)")
_FP8_KINDS = ("float8", "float6", "float4")
MATMUL_KINDS = ("forward", "dgrad", "wgrad")


@dataclasses.dataclass(frozen=True)
class ModuleReport:
    """What the ops written in one module computed in (its submodules report their own).

    Attributes:
      path: the module path (``""``: the model itself, or code outside every module).
      type_name: the module's class name.
      policy: the Policy the rules gave it (None: untouched).
      matmuls: ``"forward"``, ``"dgrad"``, ``"wgrad"`` -> the module's matmuls (excluding the
        head) as ``"lhs x rhs -> out"`` dtype strings. FP8 matmuls show FP8 operand dtypes.
      head: the same for the output head's matmul, when it is written in this module.
      head_policy: the Policy the head ran under (``Rules.head``), when ``head`` is set.
      ops: primitive -> result dtypes of its other forward ops (``exp``, ``rsqrt``,
        ``reduce_sum``, ...); ``grad_ops``: the same for the backward pass.
      output_dtypes: dtypes of floating values leaving the module.
      params: parameter name -> ``(stored dtype, gradient dtype)``.
    """

    path: str
    type_name: str
    policy: Policy | None
    matmuls: Mapping[str, tuple[str, ...]]
    head: Mapping[str, tuple[str, ...]]
    head_policy: Policy | None
    ops: Mapping[str, tuple[str, ...]]
    grad_ops: Mapping[str, tuple[str, ...]]
    output_dtypes: tuple[str, ...]
    params: Mapping[str, tuple[str, str]]

    @property
    def softmax_dtypes(self) -> tuple[str, ...]:
        """Result dtypes of the module's ``exp`` (softmax numerators)."""
        return self.ops.get("exp", ())

    @property
    def norm_dtypes(self) -> tuple[str, ...]:
        """Result dtypes of the module's ``rsqrt`` (norm statistics)."""
        return self.ops.get("rsqrt", ())

    @property
    def reduction_dtypes(self) -> tuple[str, ...]:
        """Result dtypes of the module's forward float reductions (sums, means, max)."""
        out = set()
        for name in _ops.F32_REDUCTIONS:
            out |= set(self.ops.get(name, ()))
        return tuple(sorted(out))


@dataclasses.dataclass(frozen=True)
class PolicyReport:
    """Per-module dtypes of one forward + backward pass (``inspect_policy``'s result).

    Attributes:
      modules: path -> ``ModuleReport``, in the order the modules first ran.
      params: full parameter path -> (stored, gradient) dtype.
      output_dtypes: dtypes of the model's floating outputs.
      loss_dtype: dtype of the loss.
    """

    modules: Mapping[str, ModuleReport]
    params: Mapping[str, tuple[str, str]]
    output_dtypes: tuple[str, ...]
    loss_dtype: str

    def matmuls(self, kind: str = "forward", *, head: bool = False) -> list[tuple[str, str]]:
        """All ``(module path, matmul)`` pairs of one kind (forward, dgrad, wgrad)."""
        if kind not in MATMUL_KINDS:
            raise ValueError(f"kind must be one of {MATMUL_KINDS}, got {kind!r}.")
        return [(path, d) for path, m in self.modules.items()
                for d in (m.head if head else m.matmuls).get(kind, ())]

    def __str__(self) -> str:
        lines = [f"{'module':<36} {'policy':<28} {'fwd / dgrad / wgrad matmul operands':<40} "
                 "f32 ops"]
        for path, m in self.modules.items():
            for label, table, policy in (("", m.matmuls, m.policy),
                                         ("head ", m.head, m.head_policy)):
                if not table and label:
                    continue
                pol = str(policy) if policy else "-"
                comp = " / ".join(",".join(sorted({d.split(" -> ")[0] for d in table.get(k, ())}))
                                  or "-" for k in MATMUL_KINDS)
                sens = ",".join(f"{k}:{'/'.join(v)}" for k, v in m.ops.items()
                                if k in ("exp", "log", "rsqrt", "reduce_sum", "reduce_max"))
                lines.append(f"{label + (path or '(model)'):<36} {pol:<28} {comp:<40} "
                             f"{sens or '-'}")
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
    leaves = [x for x in jax.tree.leaves(out) if is_floating(x)
              or isinstance(x, jax.ShapeDtypeStruct)]
    if not leaves:
        raise ValueError("The model returned no floating output; pass loss_fn.")
    total = jnp.sum(leaves[0].astype(jnp.float32))
    for x in leaves[1:]:
        total = total + jnp.sum(x.astype(jnp.float32))
    return total


def inspect_policy(model: Any, *inputs: Any, variables: Any = None,
                   loss_fn: Callable[[Any], jax.Array] | None = None,
                   **kwargs: Any) -> PolicyReport:
    """Reports the dtypes a model computes in, per module and op class, from the jaxpr.

    Traces (never runs) ``jax.value_and_grad`` of ``loss_fn(model(*inputs))`` with respect to
    the parameters and attributes each equation, forward and backward, to the op it came
    from: matmuls as forward / data gradient (dgrad) / weight gradient (wgrad), the output
    head, exp/log/rsqrt and reductions, and each module's outputs and parameter gradients.

    Args:
      model: a linen or NNX model or a function, wrapped by ``with_policy`` or not (unwrapped:
        what it computes as written).
      *inputs: example inputs (arrays or ``jax.ShapeDtypeStruct``; an ``nnx.Rngs`` for NNX
        models that take one).
      variables: linen only: the variables (default: ``jax.eval_shape`` of ``init``, so no
        memory is used). Gradients are taken with respect to ``variables["params"]``.
      loss_fn: maps the model's output to a scalar (default: the f32 sum of its floating
        outputs).
      **kwargs: keyword arguments of the model call (e.g. ``train=True``).

    Returns:
      A ``PolicyReport``; ``print`` it for a table.

    Example:
      >>> import jax.numpy as jnp, flax.linen as nn
      >>> from fmtkit.policy import with_policy
      >>> report = inspect_policy(with_policy(nn.Dense(4), "bf16-mixed"), jnp.ones((2, 3)))
      >>> report.modules[""].head["forward"], report.params["kernel"]
      (('bfloat16 x bfloat16 -> float32',), ('float32', 'float32'))
    """
    from fmtkit.policy._apply import with_policy

    kind = flax_kind(model)
    loss_fn = loss_fn or _default_loss
    if kind == "linen":
        from fmtkit.policy import _linen

        wrapped = model if isinstance(model, _linen.PolicyModel) else _linen.PolicyModel(
            inner=model, rules=Rules())
        if variables is None:
            keys = {"params": jax.random.key(0), "dropout": jax.random.key(1)}
            variables = jax.eval_shape(lambda ins: wrapped.init(keys, *ins, **kwargs), inputs)
        params = variables["params"]
        rest = {k: v for k, v in variables.items() if k != "params"}
        mutable = [k for k in rest if k != _linen.FP8_COLLECTION] or False
        rngs = {"dropout": jax.random.key(1)}

        def f(params, rest, ins):
            out = wrapped.apply({**rest, "params": params}, *ins, rngs=rngs,
                                mutable=mutable, **kwargs)
            out = out[0] if mutable else out
            return loss_fn(out), out
    elif kind == "nnx":
        from flax import nnx

        from fmtkit.policy import _nnx

        if variables is not None:
            raise TypeError("variables is for linen models; an NNX model holds its own.")
        wrapped = model if _nnx.is_wrapped(model) else _nnx.wrap(model, Rules(), False)
        is_node = nnx.graph.is_graph_node
        nodes = [x for x in inputs if is_node(x)]
        graphdef, params, rest = nnx.split((wrapped, *nodes), nnx.Param, ...)
        arrays = tuple(None if is_node(x) else x for x in inputs)
        node_at = [is_node(x) for x in inputs]

        def f(params, rest, ins):
            merged, *merged_nodes = nnx.merge(graphdef, params, rest)

            def loss(m, *ns):
                it = iter(ns)
                out = m(*[next(it) if n else x for x, n in zip(ins, node_at)], **kwargs)
                return loss_fn(out), out

            # NNX's own transform, with the graph-node inputs as its arguments: it lets the
            # call update BatchNorm statistics and RNG counts, which jax.value_and_grad
            # refuses (Variables mutated from another trace level).
            return nnx.value_and_grad(loss, has_aux=True)(merged, *merged_nodes)

        with _interpret.recording() as rec:
            closed, shapes = jax.make_jaxpr(f, return_shape=True)(params, rest, arrays)
        (loss_shape, out_shapes), grad_shapes = shapes
        table = _param_table(nnx.state(wrapped, nnx.Param), grad_shapes)
        return _assemble(closed, rec, table, out_shapes, loss_shape)
    else:
        if variables is not None:
            raise TypeError("variables is for linen models.")
        wrapped = model if getattr(model, "_fmtkit_rules", None) else with_policy(model, Rules())
        params, rest = inputs, None

        def f(params, rest, ins):
            del rest, ins
            out = wrapped(*params, **kwargs)
            return loss_fn(out), out

        inputs = ()

    with _interpret.recording() as rec:
        closed, shapes = jax.make_jaxpr(jax.value_and_grad(f, has_aux=True),
                                        return_shape=True)(params, rest, inputs)
    (loss_shape, out_shapes), grad_shapes = shapes
    return _assemble(closed, rec, _param_table(params, grad_shapes), out_shapes, loss_shape)


def _matmul_kind(eqn, rec: _interpret.OpRecord, backward: bool) -> str:
    """forward; or, on the backward pass, wgrad when the result has as many elements as a
    parameter operand (the weight's gradient, in whatever layout), else dgrad."""
    if not backward:
        return "forward"
    size = math.prod(getattr(eqn.outvars[0].aval, "shape", ()))
    for j in rec.param_operands:
        if j < len(rec.operand_shapes) and math.prod(rec.operand_shapes[j]) == size:
            return "wgrad"
    return "dgrad"


def _assemble(closed, rec: _interpret.Recorder, param_table, out_shapes, loss_shape
              ) -> PolicyReport:
    acc: dict[str, dict] = {}

    def entry(path):
        return acc.setdefault(path, dict(matmuls={}, head={}, ops={}, grad_ops={},
                                         head_policy=None))

    for path in rec.modules:
        entry(path)

    def visit(eqn, stack: str):
        found = _OP_RX.findall(stack)
        if not found:
            return
        op = rec.ops[int(found[-1])]
        a = entry(op.path)
        backward = "transpose(" in stack
        name = eqn.primitive.name
        if name in _ops.MATMUL and op.primitive in _ops.MATMUL:
            d = (f"{_dtype(eqn.invars[0])} x {_dtype(eqn.invars[1])} -> "
                 f"{_dtype(eqn.outvars[0])}")
            kind = _matmul_kind(eqn, op, backward)
            table = a["head" if op.head else "matmuls"].setdefault(kind, [])
            if op.head:
                a["head_policy"] = op.policy
            if d not in table:
                table.append(d)
        elif not list(jex.jaxprs_in_params(eqn.params)):
            ops = a["grad_ops" if backward else "ops"]
            ops.setdefault(name, set()).update(_dtype(v) for v in eqn.outvars)

    _walk(closed.jaxpr, "", visit)

    def frozen(d):
        return MappingProxyType({k: tuple(sorted(v)) for k, v in sorted(d.items())})

    modules = {}
    for path, a in acc.items():
        type_name, policy = rec.modules.get(path, ("-", None))
        prefix = f"{path}/" if path else ""
        own = {full[len(prefix):]: dt for full, dt in param_table.items()
               if full.startswith(prefix) and "/" not in full[len(prefix):]}
        modules[path] = ModuleReport(
            path=path, type_name=type_name, policy=policy,
            matmuls=MappingProxyType({k: tuple(v) for k, v in a["matmuls"].items()}),
            head=MappingProxyType({k: tuple(v) for k, v in a["head"].items()}),
            head_policy=a["head_policy"],
            ops=frozen(a["ops"]), grad_ops=frozen(a["grad_ops"]),
            output_dtypes=tuple(sorted(rec.exits.get(path, ()))),
            params=MappingProxyType(own))
    out_dtypes = tuple(sorted({str(s.dtype) for s in jax.tree.leaves(out_shapes)
                               if jnp.issubdtype(s.dtype, jnp.floating)}))
    return PolicyReport(modules=MappingProxyType(modules), params=MappingProxyType(param_table),
                        output_dtypes=out_dtypes, loss_dtype=str(loss_shape.dtype))
