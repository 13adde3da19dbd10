"""Bytes ledger: what parameters, gradients, optimizer state and master copy cost per parameter.

Measured from the real state pytrees, not from a formula: the optimizer's ``init`` is traced
with ``jax.eval_shape`` (nothing is allocated) and every leaf's ``size * itemsize`` is
counted. A ``fmtkit.optim.master_weights`` master copy is reported on its own line; 0-d state
leaves (step counters, the loss scale, seeds) are a fixed cost reported as ``scalar_bytes``
and left out of the per-parameter figure.

Example (bf16 parameters, f32 masters, AdamW with f32 moments: 2 + 2 + 4 + 8 = 16 bytes per
parameter, the figure of Rajbhandari et al. 2020, "ZeRO", section 3.1)::

    >>> import optax
    >>> from fmtkit.optim import master_weights
    >>> params = {"w": jax.ShapeDtypeStruct((1024, 1024), jnp.bfloat16)}
    >>> ledger(params, master_weights(optax.adamw(1e-3))).bytes_per_param
    16.0
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fmtkit.formats import get_format
from fmtkit.fp4 import Fp4Array
from fmtkit.optim import MasterWeightsState

__all__ = ["MemoryLedger", "ledger"]


@dataclasses.dataclass(frozen=True)
class MemoryLedger:
    """Byte counts of one training configuration (see ``ledger``).

    Attributes:
      num_params: number of parameter elements.
      param_bytes: the parameters as stored.
      grad_bytes: one gradient tree.
      master_bytes: the master copy held by ``master_weights`` (0 without one).
      opt_state_bytes: the rest of the optimizer state with one or more dimensions (moments,
        their scales, compensation buffers).
      scalar_bytes: 0-d optimizer-state leaves (counters, loss scale): a fixed cost.

    Example:
      >>> from fmtkit import optim
      >>> opt = optim.master_weights(optax.adamw(1e-3))
      >>> print(ledger({"w": jnp.ones((4, 4), jnp.bfloat16)}, opt))   # bf16 + AdamW + masters
      component                 bytes  bytes/param
      params                       32       2.0000
      grads                        32       2.0000
      master copy                  64       4.0000
      optimizer state             128       8.0000
      total                       256      16.0000
      (+ 8 bytes of scalar state; 16 parameters)
    """

    num_params: int
    param_bytes: int
    grad_bytes: int
    master_bytes: int
    opt_state_bytes: int
    scalar_bytes: int

    @property
    def total_bytes(self) -> int:
        """Everything, the fixed scalars included."""
        return (self.param_bytes + self.grad_bytes + self.master_bytes
                + self.opt_state_bytes + self.scalar_bytes)

    @property
    def bytes_per_param(self) -> float:
        """(params + grads + master + optimizer state) / num_params; scalars excluded."""
        return self.per_param()["total"]

    def per_param(self) -> dict[str, float]:
        """Bytes per parameter of each component and their total (scalars excluded)."""
        n = max(self.num_params, 1)
        parts = {"params": self.param_bytes / n, "grads": self.grad_bytes / n,
                 "master": self.master_bytes / n, "opt_state": self.opt_state_bytes / n}
        parts["total"] = (self.param_bytes + self.grad_bytes + self.master_bytes
                          + self.opt_state_bytes) / n
        return parts

    def as_dict(self) -> dict[str, Any]:
        """All fields, the totals and the per-parameter figures (JSON-ready)."""
        return {**dataclasses.asdict(self), "total_bytes": self.total_bytes,
                "bytes_per_param": self.per_param()}

    def __str__(self) -> str:
        per = self.per_param()
        rows = [("params", self.param_bytes, per["params"]),
                ("grads", self.grad_bytes, per["grads"]),
                ("master copy", self.master_bytes, per["master"]),
                ("optimizer state", self.opt_state_bytes, per["opt_state"]),
                ("total", self.total_bytes - self.scalar_bytes, per["total"])]
        lines = [f"{'component':<16} {'bytes':>14} {'bytes/param':>12}"]
        lines += [f"{k:<16} {b:>14,d} {p:>12.4f}" for k, b, p in rows]
        lines.append(f"(+ {self.scalar_bytes} bytes of scalar state; "
                     f"{self.num_params:,d} parameters)")
        return "\n".join(lines)


def _leaf_bytes(x: Any) -> int:
    """Bytes of one array as stored: sub-byte formats packed (two E2M1 values per byte, as
    Blackwell and the OCP MX spec store them; NumPy holds them one per byte)."""
    if isinstance(x, Fp4Array):
        return sum(_leaf_bytes(leaf) for leaf in jax.tree.leaves(x))
    dtype = x.dtype
    if jax.dtypes.issubdtype(dtype, jax.dtypes.extended):  # typed PRNG keys
        return _leaf_bytes(jax.eval_shape(jax.random.key_data, x))
    n = int(np.prod(x.shape, dtype=np.int64))
    if jnp.issubdtype(dtype, jnp.floating):
        bits = get_format(dtype).bits
        if bits < 8:
            return -(-n * bits // 8)
    return n * np.dtype(dtype).itemsize


def _is_fp4(x: Any) -> bool:
    return isinstance(x, Fp4Array)


def _split_state(state: Any) -> tuple[list[Any], list[Any]]:
    """(master leaves, other leaves) of an optimizer state."""
    masters, others = [], []
    nodes = jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, MasterWeightsState))
    for node in nodes:
        if isinstance(node, MasterWeightsState):
            masters += jax.tree.leaves(node.master)
            others += jax.tree.leaves((node.count, node.seed))
            m, o = _split_state(node.inner_state)
            masters += m
            others += o
        else:
            others.append(node)
    return masters, others


def _dtype_or_none(value: Any, name: str) -> np.dtype | None:
    if value is None:
        return None
    dtype = np.dtype(get_format(value).dtype if isinstance(value, str) else value)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"{name} must be a floating dtype, got {dtype}.")
    return dtype


def ledger(params: Any, optimizer: optax.GradientTransformation | None = None, *,
           param_dtype: Any = None, grad_dtype: Any = None, policy: Any = None
           ) -> MemoryLedger:
    """Counts the bytes of params, grads, optimizer state and master copy.

    Args:
      params: the parameter tree: arrays or ``jax.ShapeDtypeStruct`` (nothing is allocated),
        or ``fmtkit.fp4.Fp4Array`` leaves (FP4 storage: packed E2M1 values, 0.5 byte each,
        plus their block scales and tensor scale; e.g. ``jax.eval_shape`` of
        ``fp4.nvfp4_quantize``): NVFP4 costs 0.5 + 1/16 bytes per parameter, MXFP4
        0.5 + 1/32. Their gradients and optimizer state take the full shape.
      optimizer: an optax transformation; its state is ``jax.eval_shape(optimizer.init,
        params)``. ``None``: no optimizer state.
      param_dtype: store every floating parameter in this dtype instead (a policy's ``p``).
      grad_dtype: dtype of the gradient tree; default: each parameter's (stored) dtype.
      policy: any object with ``param_dtype`` / ``grad_dtype`` attributes (e.g.
        ``fmtkit.Policy``); explicit ``param_dtype`` / ``grad_dtype`` take precedence.

    Returns:
      A ``MemoryLedger``.

    Raises:
      TypeError: a non-floating ``param_dtype`` / ``grad_dtype``.

    Example:
      >>> params = {"w": jax.ShapeDtypeStruct((256, 256), jnp.float32)}
      >>> ledger(params, optax.adamw(1e-3)).bytes_per_param
      16.0
    """
    if policy is not None:
        param_dtype = param_dtype if param_dtype is not None else getattr(
            policy, "param_dtype", None)
        grad_dtype = grad_dtype if grad_dtype is not None else getattr(
            policy, "grad_dtype", None)
    param_dtype = _dtype_or_none(param_dtype, "param_dtype")
    grad_dtype = _dtype_or_none(grad_dtype, "grad_dtype")

    def spec(x, dtype):
        if _is_fp4(x):  # FP4 storage: values with their scales, counted as stored
            return x
        x_dtype = jnp.result_type(x)
        if dtype is not None and jnp.issubdtype(x_dtype, jnp.floating):
            x_dtype = dtype
        return jax.ShapeDtypeStruct(jnp.shape(x), x_dtype)

    p_spec = jax.tree.map(lambda x: spec(x, param_dtype), params, is_leaf=_is_fp4)
    # An FP4-stored parameter's gradient and optimizer state have its full shape (f32, or
    # grad_dtype): FP4 is a storage / GEMM format, not one to accumulate in.
    full = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.values.shape, jnp.float32)
                        if _is_fp4(x) else x, p_spec, is_leaf=_is_fp4)
    g_spec = jax.tree.map(lambda x: spec(x, grad_dtype), full)
    p_leaves = jax.tree.leaves(p_spec, is_leaf=_is_fp4)
    masters, others = [], []
    if optimizer is not None:
        masters, others = _split_state(jax.eval_shape(optimizer.init, full))
    scalars = [x for x in others if len(x.shape) == 0]
    arrays = [x for x in others if len(x.shape) > 0]
    return MemoryLedger(
        num_params=sum(int(np.prod((x.values if _is_fp4(x) else x).shape, dtype=np.int64))
                       for x in p_leaves),
        param_bytes=sum(map(_leaf_bytes, p_leaves)),
        grad_bytes=sum(map(_leaf_bytes, jax.tree.leaves(g_spec))),
        master_bytes=sum(map(_leaf_bytes, masters)),
        opt_state_bytes=sum(map(_leaf_bytes, arrays)),
        scalar_bytes=sum(map(_leaf_bytes, scalars)),
    )
