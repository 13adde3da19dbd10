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
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np
from jax.interpreters import partial_eval as pe

from fmtkit import fp4, fp8
from fmtkit._switches import SWITCHES
from fmtkit.policy import _ops
from fmtkit.policy._apply import flax_kind
from fmtkit.policy._engine import scopes
from fmtkit.policy._frontends import functions
from fmtkit.policy._policy import Policy, Rules, is_floating

__all__ = ["MatmulOp", "ModuleReport", "PolicyReport", "inspect_policy"]

_OP_RX = re.compile(re.escape(scopes.OP_SCOPE) + r"(\d+)")
# An emulated FP8 GEMM whose dot reads its operands widened to bf16 (fmtkit.fp8.WIDENED_SCOPE)
_WIDENED_RX = re.compile(re.escape(fp8.WIDENED_SCOPE) + r"-(\w+)-(\w+)")
# An FP4 GEMM's scope names its operands' block shapes (fmtkit.fp4.GEMM_SCOPE).
_FP4_RX = re.compile(re.escape(fp4.GEMM_SCOPE) + r"_(\d+x\d+)_(\d+x\d+)")
_E2M1 = "float4_e2m1fn"
_FP8_KINDS = ("float8", "float6", "float4")
MATMUL_KINDS = ("forward", "dgrad", "wgrad")
# The name JAX gives the forward computation a checkpoint (remat) replays on the backward pass.
_REMAT_SCOPE = "rematted_computation"


@dataclasses.dataclass(frozen=True)
class ModuleReport:
    """What the ops written in one module computed in (its submodules report their own).

    Attributes:
      path: the module path (``""``: the model itself, or code outside every module).
      type_name: the module's class name.
      policy: the Policy the rules gave it (None: untouched).
      matmuls: ``"forward"``, ``"dgrad"``, ``"wgrad"`` -> the module's matmuls (excluding the
        head) as ``"lhs x rhs -> out"`` dtype strings. FP8 matmuls show FP8 operand dtypes, FP4
        ones ``float4_e2m1fn`` (``MatmulOp.blocks``).
      head: the same for the output head's matmul, when it is written in this module.
      head_policy: the Policy the head ran under (``Rules.head``), when ``head`` is set.
      ops: primitive -> result dtypes of its other forward ops (``exp``, ``rsqrt``,
        ``reduce_sum``, ...); ``grad_ops``: the same for the backward pass.
      output_dtypes: dtypes of floating values leaving the module.
      params: parameter name -> ``(stored dtype, gradient dtype)``.
      rule: the pattern of the rule that gave the module its policy (None: the rules'
        default, or no rule at all).
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
    rule: str | None = None

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
class MatmulOp:
    """One matmul or convolution equation of the inspected computation.

    Attributes:
      path: the module it was written in (``""``: the model itself or no module).
      primitive: ``"dot_general"``, ``"conv_general_dilated"``, ``"ragged_dot_general"``
        (``lax.ragged_dot``) or ``"scaled_dot"``.
      kind: ``"forward"``, ``"dgrad"`` or ``"wgrad"`` (a backward matmul outside a policied op
        is ``"dgrad"`` or ``"wgrad"`` by the same shape test, or ``"backward"``).
      dtypes: ``"lhs x rhs -> out"``.
      flops: 2 x output elements x contraction size, times the length of enclosing scans and
        the grid of an enclosing ``pallas_call`` (a ``while`` body counts once: its trip count
        is not known from the jaxpr). A grouped GEMM (``ragged_dot``) counts each row once,
        with the weights of its group.
      policied: it ran as an op the policy interpreted, under a Policy (or ``Rules.head``).
      reason: why not, when not: ``"no rule"`` (a module the rules leave untouched),
        ``"opaque <primitive>"`` (inside a body the policy cannot interpret, e.g.
        ``pallas_call``), ``"custom_vjp backward"`` (a user's backward rule, run as written
        on its residuals), ``"outside the policy"`` (an unwrapped model).
      head: it is the output head's matmul.
      projection: one of its operands is a view of a parameter (what the FP8 presets target);
        a backward matmul inherits its forward op's.
      blocks: an FP4 GEMM's operand block shapes over their [free, contraction] dims,
        ``"lhs x rhs"`` (e.g. ``"1x16 x 16x16"``: NVFP4's activations or gradients times its
        2D weight blocks); ``""`` for other matmuls. Its ``dtypes`` name the operands E2M1
        (``float4_e2m1fn``), the format the GEMM computes in, though the emulated dot reads
        them widened exactly to E4M3 (``fmtkit.fp4``).
      groups: a grouped GEMM's (``lax.ragged_dot``) number of groups; 0 for other matmuls.
    """

    path: str
    primitive: str
    kind: str
    dtypes: str
    flops: int
    policied: bool
    reason: str = ""
    head: bool = False
    projection: bool = False
    blocks: str = ""
    groups: int = 0

    @property
    def low_precision(self) -> bool:
        """Both operands are 8-bit or narrower floats (FP8, or FP4 widened exactly to E4M3
        for the emulated GEMM)."""
        lhs, rhs = (jnp.dtype(t) for t in self.dtypes.split(" -> ")[0].split(" x "))
        return all(jnp.issubdtype(t, jnp.floating) and t.itemsize == 1 for t in (lhs, rhs))


@dataclasses.dataclass(frozen=True)
class PolicyReport:
    """Per-module dtypes of one forward + backward pass (``inspect_policy``'s result).

    Attributes:
      modules: path -> ``ModuleReport``, in the order the modules first ran.
      params: full parameter path -> (stored, gradient) dtype.
      output_dtypes: dtypes of the model's floating outputs.
      loss_dtype: dtype of the loss.
      matmul_ops: every matmul and convolution of the traced computation (forward, and
        backward unless ``backward=False``), each with its FLOPs and whether it ran under
        the policy (``MatmulOp``); those it did not are listed too, flagged.
      opaque: ``(module path, primitive)`` of every body the policy ran as traced.
    """

    modules: Mapping[str, ModuleReport]
    params: Mapping[str, tuple[str, str]]
    output_dtypes: tuple[str, ...]
    loss_dtype: str
    matmul_ops: tuple[MatmulOp, ...] = ()
    opaque: tuple[tuple[str, str], ...] = ()

    def policied_fraction(self, kind: str | None = None) -> float:
        """The share of matmul FLOPs (of one ``kind``, default all) that ran under the
        policy: 1.0 when every matmul and convolution did (nan when there are none).

        Example: ``assert inspect_policy(model, x).policied_fraction() == 1.0``.
        """
        if kind is not None and kind not in (*MATMUL_KINDS, "backward"):
            raise ValueError(f"kind must be None or one of {MATMUL_KINDS}, got {kind!r}.")
        sel = [m for m in self.matmul_ops if kind is None or m.kind == kind]
        total = sum(m.flops for m in sel)
        return sum(m.flops for m in sel if m.policied) / total if total else float("nan")

    def fp8_fraction(self, kind: str = "forward") -> float:
        """The share of the FLOPs of the non-head parameter matmuls (projections) of one
        ``kind`` that ran on FP8 (or FP4) operands: what an FP8 preset promises to cover.

        Convolutions are not counted: the FP8 recipes target matmuls (``dot_general``), and
        convolutions run on the compute dtype under FP8 presets (``str(report)`` lists their
        FLOPs on a line of their own, and the policied call warns, naming their modules).
        Grouped GEMMs (``lax.ragged_dot``) are counted: as FP8 under FP8 presets
        (``fmtkit.fp8.ragged_dot``), as not FP8 under FP4 presets (the policy warns about
        them).

        Example: ``assert inspect_policy(model, x).fp8_fraction("dgrad") >= 0.95``.
        """
        if kind not in MATMUL_KINDS:
            raise ValueError(f"kind must be one of {MATMUL_KINDS}, got {kind!r}.")
        sel = [m for m in self.matmul_ops if m.kind == kind and m.projection and not m.head
               and m.primitive != _CONV]
        total = sum(m.flops for m in sel)
        return sum(m.flops for m in sel if m.low_precision) / total if total else float("nan")

    def unpolicied(self) -> list[MatmulOp]:
        """The matmuls and convolutions that did not run under the policy."""
        return [m for m in self.matmul_ops if not m.policied]

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
        if self.matmul_ops:
            total = sum(m.flops for m in self.matmul_ops)
            lines.append(f"matmul FLOPs under the policy: {self.policied_fraction():.1%} "
                         f"of {total:,}")
        convs = [m for m in self.matmul_ops if m.primitive == _CONV]
        if convs and any(m.low_precision for m in self.matmul_ops):
            dts = ", ".join(sorted({m.dtypes.split(" -> ")[0] for m in convs}))
            lines.append(f"convolutions: {sum(m.flops for m in convs):,} FLOPs on {dts}, "
                         "not targeted by the FP8 recipes (not counted by fp8_fraction)")
        for m in self.unpolicied():
            lines.append(f"  not policied ({m.reason}): {m.path or '(model)'} {m.primitive} "
                         f"{m.kind} {m.dtypes}, {m.flops:,} FLOPs")
        return "\n".join(lines)


_CONV = "conv_general_dilated"


def _dtype(v) -> str:
    return str(v.aval.dtype) if hasattr(v.aval, "dtype") else "-"


def _walk(jaxpr, prefix: str, visit: Callable, times: int = 1) -> None:
    """Calls ``visit(eqn, full name stack, times)`` on every equation, sub-jaxprs included
    (``times``: the product of the enclosing scans' lengths)."""
    for eqn in jaxpr.eqns:
        stack = str(eqn.source_info.name_stack)
        full = f"{prefix}/{stack}" if prefix and stack else (prefix or stack)
        visit(eqn, full, times)
        inner = times
        if eqn.primitive.name == "scan":
            inner = times * int(eqn.params.get("length", 1))
        elif eqn.primitive.name == "pallas_call":  # the kernel body runs once per grid step
            grid = getattr(eqn.params.get("grid_mapping"), "grid", ())
            inner = times * math.prod(g for g in grid if isinstance(g, int))
        for sub in jex.jaxprs_in_params(eqn.params):
            _walk(getattr(sub, "jaxpr", sub), full, visit, inner)


def matmul_flops(eqn) -> int:
    """2 x (output elements) x (contraction size) of a ``dot_general``, ``scaled_dot`` or
    convolution; of a ``ragged_dot_general``, 2 x (lhs elements) x (rhs elements that are
    neither contracted, batched nor a group): each lhs row meets one group's weights."""
    out = eqn.outvars[0].aval
    if eqn.primitive.name == "ragged_dot_general":
        rd = eqn.params["ragged_dot_dimension_numbers"]
        (_, rhs_contract), (_, rhs_batch) = rd.dot_dimension_numbers
        rhs = eqn.invars[1].aval
        skip = {*rhs_contract, *rhs_batch, *rd.rhs_group_dimensions}
        free = math.prod(n for i, n in enumerate(rhs.shape) if i not in skip)
        return 2 * math.prod(eqn.invars[0].aval.shape) * free
    if eqn.primitive.name in ("dot_general", "scaled_dot"):
        (lhs_contract, _), _ = eqn.params["dimension_numbers"]
        lhs = eqn.invars[0].aval
        return 2 * math.prod(out.shape) * math.prod(lhs.shape[i] for i in lhs_contract)
    rhs = eqn.invars[1].aval
    out_features = rhs.shape[eqn.params["dimension_numbers"].rhs_spec[0]]
    return 2 * math.prod(out.shape) * math.prod(rhs.shape) // max(out_features, 1)


def _key_str(entry) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(entry, attr):
            return str(getattr(entry, attr))
    return str(entry)


def _param_table(params, grads) -> dict[str, tuple[str, str]]:
    flat_p = jax.tree_util.tree_flatten_with_path(params)[0]
    flat_g = jax.tree.leaves(grads) if grads is not None else [None] * len(flat_p)
    out = {}
    for (path, p), g in zip(flat_p, flat_g):
        parts = [_key_str(k) for k in path]
        while parts and parts[-1] in ("value", "raw_value", "_raw_value"):
            parts.pop()
        out["/".join(parts)] = (str(p.dtype), "-" if g is None else str(g.dtype))
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
                   loss_fn: Callable[[Any], jax.Array] | None = None, backward: bool = True,
                   argnums: int | Sequence[int] | None = None,
                   rngs: Mapping[str, Any] | None = None,
                   **kwargs: Any) -> PolicyReport:
    """Reports the dtypes a model computes in, per module and op class, from the jaxpr.

    Traces (never runs) ``jax.value_and_grad`` of ``loss_fn(model(*inputs))`` with respect to
    the parameters and attributes each equation, forward and backward, to the op it came
    from: matmuls as forward / data gradient (dgrad) / weight gradient (wgrad), the output
    head, exp/log/rsqrt and reductions, and each module's outputs and parameter gradients.
    Every matmul and convolution is listed with its FLOPs (``PolicyReport.matmul_ops``),
    those that did not run under the policy flagged, so a test can assert
    ``report.policied_fraction() == 1.0``.

    Args:
      model: a linen or NNX model or a function, wrapped by ``with_policy`` or not (unwrapped:
        what it computes as written).
      *inputs: example inputs (arrays or ``jax.ShapeDtypeStruct``; an ``nnx.Rngs`` for NNX
        models that take one). Leaves that are not arrays (a Python ``bool`` flag, a string)
        are static: passed as they are, never traced.
      variables: linen only: the variables (default: ``jax.eval_shape`` of ``init``, so no
        memory is used). Gradients are taken with respect to ``variables["params"]``.
      loss_fn: maps the model's output to a scalar (default: the f32 sum of its floating
        outputs).
      backward: False traces the forward pass only (inference; models with a ``while`` loop,
        which JAX cannot differentiate): parameter gradient dtypes are then ``"-"``.
      argnums: functions only: the positional inputs to differentiate (default: every one);
        only their floating leaves are differentiated (integer token ids and PRNG keys are
        inputs, never differentiated).
      rngs: linen only: RNG streams for ``init`` and ``apply`` (default
        ``{"dropout": jax.random.key(1)}``), e.g. ``{"noise": key}``.
      **kwargs: keyword arguments of the model call (e.g. ``train=True``).

    Returns:
      A ``PolicyReport``; ``print`` it for a table.

    Raises:
      TypeError: ``variables``/``rngs`` for a model that is not linen; ``argnums`` for a
        model that is not a function, or out of range.

    Example:
      >>> import jax.numpy as jnp, flax.linen as nn
      >>> from fmtkit.policy import with_policy
      >>> report = inspect_policy(with_policy(nn.Dense(4), "bf16-mixed"), jnp.ones((2, 3)))
      >>> report.modules[""].head["forward"], report.params["kernel"]
      (('bfloat16 x bfloat16 -> float32',), ('float32', 'float32'))
      >>> report.policied_fraction()
      1.0
    """
    from fmtkit.policy._apply import with_policy

    kind = flax_kind(model)
    loss_fn = loss_fn or _default_loss
    if not isinstance(backward, bool):
        raise TypeError(f"backward must be a bool, got {type(backward).__name__}.")
    if argnums is not None and kind != "function":
        raise TypeError("argnums is for functions; a Flax model is differentiated with respect "
                        "to its parameters.")
    if rngs is not None and kind != "linen":
        raise TypeError("rngs is for linen models (an NNX model takes an nnx.Rngs input).")
    # Non-array leaves of the inputs are static: closed over, never traced.
    in_leaves, in_tree = jax.tree.flatten(inputs)
    dynamic = [_is_input_array(x) for x in in_leaves]

    def rebuild(arrays):
        it = iter(arrays)
        return jax.tree.unflatten(in_tree, [next(it) if d else x
                                            for x, d in zip(in_leaves, dynamic)])

    in_arrays = [x for x, d in zip(in_leaves, dynamic) if d]
    if kind == "linen":
        from fmtkit.policy._frontends import linen

        wrapped = model if isinstance(model, linen.PolicyModel) else linen.PolicyModel(
            inner=model, rules=Rules())
        streams = dict(rngs) if rngs is not None else {"dropout": jax.random.key(1)}
        if variables is None:
            if inputs and isinstance(inputs[0], Mapping) and "params" in inputs[0]:
                # inspect_policy(model, variables, x), apply's order: a TypeError from the
                # model's __call__ deep inside init would not say what went wrong.
                raise TypeError(
                    "inspect_policy's first input looks like the model's variables (a dict "
                    "with 'params'); pass them by keyword: inspect_policy(model, *inputs, "
                    "variables=variables).")
            keys = {"params": jax.random.key(0), **streams}
            variables = jax.eval_shape(
                lambda arrs: wrapped.init(keys, *rebuild(arrs), **kwargs), in_arrays)
        params = variables["params"]
        rest = {k: v for k, v in variables.items() if k != "params"}
        mutable = [k for k in rest if k != linen.FP8_COLLECTION] or False

        def f(params, rest, arrs):
            out = wrapped.apply({**rest, "params": params}, *rebuild(arrs), rngs=streams,
                                mutable=mutable, **kwargs)
            out = out[0] if mutable else out
            return loss_fn(out), out
    elif kind == "nnx":
        from flax import nnx

        from fmtkit.policy._frontends import nnx as nnx_frontend

        if variables is not None:
            raise TypeError("variables is for linen models; an NNX model holds its own.")
        wrapped = (model if nnx_frontend.is_wrapped(model)
                   else nnx_frontend.wrap(model, Rules(), strict=False))
        is_node = nnx.graph.is_graph_node
        nodes = [x for x in inputs if is_node(x)]
        graphdef, params, rest = nnx.split((wrapped, *nodes), nnx.Param, ...)
        node_at = [is_node(x) for x in inputs]
        plain = tuple(None if is_node(x) else x for x in inputs)
        p_leaves, p_tree = jax.tree.flatten(plain)
        p_dyn = [_is_input_array(x) for x in p_leaves]
        arrays = [x for x, d in zip(p_leaves, p_dyn) if d]

        def nnx_f(params, rest, arrs):
            merged, *merged_nodes = nnx.merge(graphdef, params, rest)
            it = iter(arrs)
            ins = jax.tree.unflatten(p_tree, [next(it) if d else x
                                              for x, d in zip(p_leaves, p_dyn)])

            def loss(m, *ns):
                it = iter(ns)
                out = m(*[next(it) if n else x for x, n in zip(ins, node_at)], **kwargs)
                return loss_fn(out), out

            if not backward:
                return loss(merged, *merged_nodes), None
            # NNX's own transform, with the graph-node inputs as its arguments: it lets the
            # call update BatchNorm statistics and RNG counts, which jax.value_and_grad
            # refuses (Variables mutated from another trace level).
            return nnx.value_and_grad(loss, has_aux=True)(merged, *merged_nodes)

        with scopes.recording() as rec:
            closed, shapes = jax.make_jaxpr(nnx_f, return_shape=True)(params, rest, arrays)
        (loss_shape, out_shapes), grad_shapes = shapes
        table = _param_table(nnx.state(wrapped, nnx.Param), grad_shapes)
        return _assemble(closed, rec, table, out_shapes, loss_shape)
    else:
        if variables is not None:
            raise TypeError("variables is for linen models.")
        wrapped = model if functions.is_wrapped(model) else with_policy(model, Rules())
        positions = _argnums(argnums, len(inputs))
        # Differentiated: the floating array leaves of the chosen positional inputs.
        leaf_pos = [i for i, x in enumerate(inputs) for _ in jax.tree.leaves(x)]
        diff = [d and p in positions and _is_float_input(x)
                for x, d, p in zip(in_leaves, dynamic, leaf_pos)]
        with_path = jax.tree_util.tree_flatten_with_path(inputs)[0]
        params = {"/".join(_key_str(k) for k in path): x
                  for (path, x), dd in zip(with_path, diff) if dd}
        rest = [x for x, d, dd in zip(in_leaves, dynamic, diff) if d and not dd]
        # JAX rebuilds a dict with its keys sorted: read the leaves back in flattening order.
        order = list(params)

        def f(params, rest, arrs):
            del arrs
            it_p, it_r = iter([params[k] for k in order]), iter(rest)
            full = [(next(it_p) if dd else next(it_r)) if d else x
                    for x, d, dd in zip(in_leaves, dynamic, diff)]
            out = wrapped(*jax.tree.unflatten(in_tree, full), **kwargs)
            return loss_fn(out), out

        in_arrays = ()

    traced = jax.value_and_grad(f, has_aux=True) if backward else (
        lambda *a: (f(*a), None))
    with scopes.recording() as rec:
        closed, shapes = jax.make_jaxpr(traced, return_shape=True)(params, rest, in_arrays)
    (loss_shape, out_shapes), grad_shapes = shapes
    return _assemble(closed, rec, _param_table(params, grad_shapes), out_shapes, loss_shape)


def _is_input_array(x) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct))


def _is_float_input(x) -> bool:
    return jnp.issubdtype(x.dtype, jnp.floating)


def _argnums(argnums, n: int) -> frozenset[int]:
    if argnums is None:
        return frozenset(range(n))
    nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    if not all(isinstance(i, int) and -n <= i < n for i in nums):
        raise TypeError(f"argnums must be ints in [-{n}, {n}) for {n} positional inputs, "
                        f"got {argnums!r}.")
    return frozenset(i % n for i in nums)


def _matmul_kind(eqn, rec: scopes.OpRecord, backward: bool, stack: str) -> str:
    """forward (a forward matmul that ``jax.checkpoint`` recomputes on the backward pass
    too: JAX names that recomputation ``_REMAT_SCOPE``); or, on the backward pass, what an
    FP8 / FP4 dot's backward scope says, else wgrad when the result has as many elements as a
    parameter operand (the weight's gradient, in whatever layout), else dgrad."""
    if not backward or (SWITCHES.remat_forward_kind and _REMAT_SCOPE in stack):
        return "forward"
    if fp8.WGRAD_SCOPE in stack:
        return "wgrad"
    if fp8.DGRAD_SCOPE in stack:
        return "dgrad"
    size = math.prod(getattr(eqn.outvars[0].aval, "shape", ()))
    for j in rec.param_operands:
        if j < len(rec.operand_shapes) and math.prod(rec.operand_shapes[j]) == size:
            return "wgrad"
    return "dgrad"


def _live(closed: jex.ClosedJaxpr) -> jex.ClosedJaxpr:
    """``closed`` without the equations whose results nothing uses, inside bodies too (what
    XLA drops from the compiled step): e.g. the data gradient into a ``lax.scan``'s inputs
    that are not differentiated, which an FP8 GEMM's backward writes in the scan's
    transposed body and JAX leaves there."""
    jaxpr, _ = pe.dce_jaxpr(closed.jaxpr, [True] * len(closed.jaxpr.outvars),
                            instantiate=True)
    return jex.ClosedJaxpr(jaxpr, closed.consts)


def _assemble(closed, rec: scopes.Recorder, param_table, out_shapes, loss_shape
              ) -> PolicyReport:
    closed = _live(closed)  # the report counts what runs
    acc: dict[str, dict] = {}

    def entry(path):
        return acc.setdefault(path, dict(matmuls={}, head={}, ops={}, grad_ops={},
                                         head_policy=None))

    for path in rec.modules:
        entry(path)

    found_ops: list[MatmulOp] = []

    def visit(eqn, stack: str, times: int):
        found = _OP_RX.findall(stack)
        name = eqn.primitive.name
        backward = "transpose(" in stack
        op = rec.ops[int(found[-1])] if found else None
        if name in _ops.MATMUL_LIKE and (op is None or op.primitive not in _ops.MATMUL_LIKE):
            found_ops.append(MatmulOp(
                path=op.path if op else "", primitive=name,
                kind="backward" if backward else "forward", dtypes=_matmul_dtypes(eqn),
                flops=matmul_flops(eqn) * times, policied=False,
                reason=_not_policied(op), groups=_groups(eqn)))
            return
        if op is None:
            return
        a = entry(op.path)
        if name in _ops.MATMUL_LIKE:
            d = _matmul_dtypes(eqn)
            widened = _WIDENED_RX.findall(stack)
            if widened:  # off GPUs an FP8 GEMM's dot reads its operands widened to bf16
                d = f"{widened[-1][0]} x {widened[-1][1]} -> {_dtype(eqn.outvars[0])}"
            fp4_gemm = _FP4_RX.findall(stack)
            if fp4_gemm:  # the emulation's dot reads the E2M1 operands widened to E4M3
                d = f"{_E2M1} x {_E2M1} -> {_dtype(eqn.outvars[0])}"
            kind = _matmul_kind(eqn, op, backward, stack)
            table = a["head" if op.head else "matmuls"].setdefault(kind, [])
            if op.head:
                a["head_policy"] = op.policy
            if d not in table:
                table.append(d)
            found_ops.append(MatmulOp(
                path=op.path, primitive=name, kind=kind, dtypes=d,
                flops=matmul_flops(eqn) * times, policied=op.policy is not None,
                reason="" if op.policy is not None else "no rule", head=op.head,
                projection=op.projection,
                blocks=" x ".join(fp4_gemm[-1]) if fp4_gemm else "",
                groups=_groups(eqn)))
        elif not list(jex.jaxprs_in_params(eqn.params)):
            ops = a["grad_ops" if backward else "ops"]
            ops.setdefault(name, set()).update(_dtype(v) for v in eqn.outvars)

    _walk(closed.jaxpr, "", visit)

    def frozen(d):
        return MappingProxyType({k: tuple(sorted(v)) for k, v in sorted(d.items())})

    modules = {}
    for path, a in acc.items():
        type_name, policy, rule = rec.modules.get(path, ("-", None, None))
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
            params=MappingProxyType(own), rule=rule)
    out_dtypes = tuple(sorted({str(s.dtype) for s in jax.tree.leaves(out_shapes)
                               if jnp.issubdtype(s.dtype, jnp.floating)}))
    return PolicyReport(modules=MappingProxyType(modules), params=MappingProxyType(param_table),
                        output_dtypes=out_dtypes, loss_dtype=str(loss_shape.dtype),
                        matmul_ops=tuple(found_ops), opaque=tuple(dict.fromkeys(rec.opaque)))


def _groups(eqn) -> int:
    """A grouped GEMM's number of groups (its group sizes' last axis), else 0."""
    if eqn.primitive.name != "ragged_dot_general":
        return 0
    return int(eqn.invars[2].aval.shape[-1])


def _matmul_dtypes(eqn) -> str:
    return f"{_dtype(eqn.invars[0])} x {_dtype(eqn.invars[1])} -> {_dtype(eqn.outvars[0])}"


def _not_policied(op: scopes.OpRecord | None) -> str:
    """Why a matmul that is not an interpreted matmul op ran as traced."""
    if op is None:
        return "outside the policy"
    if op.primitive == "custom_vjp_call":
        return "custom_vjp backward"
    if op.primitive == "custom_jvp_call":
        return "custom_jvp rule"
    return f"opaque {op.primitive}"
