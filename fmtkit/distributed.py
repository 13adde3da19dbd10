"""Gradient reduction across data-parallel devices, in a chosen precision (inside ``shard_map``).

Under ``jax.jit`` with ``NamedSharding`` the reduction of a data-parallel gradient is inserted
by XLA, in the gradient's dtype: to reduce in f32, keep the gradients in f32 up to the
reduction (fmtkit policies deliver parameter gradients in ``param_dtype``, f32 by default).
Inside ``shard_map`` the reduction is explicit, and these helpers make its precision a
choice (``Policy.reduce_dtype``):

    "psum" in dtype d:      every device's gradient cast to d, summed by the collective in d
    "gather" (comm c, acc a): gradients sent in c (``all_gather``), summed locally in a, so the
                             wire carries c (e.g. bf16) while no partial sum is rounded to c

The collective's own summation order is the backend's (a ring or tree on GPUs); a low
precision ``psum`` rounds every partial sum, so its error grows with the device count.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from fmtkit.formats import get_format

__all__ = ["reduce_gradients"]


def _dtype(name: Any, arg: str) -> Any:
    fmt = get_format(name)
    if fmt.is_fp8_family:
        raise ValueError(f"{arg}={name!r}: reductions run in float32, bfloat16 or float16.")
    return fmt.dtype


def reduce_gradients(grads: Any, axis_name: str | tuple[str, ...], *,
                     dtype: Any = "float32", comm_dtype: Any | None = None,
                     mean: bool = True) -> Any:
    """Sums (or averages) a gradient pytree over the mesh axis ``axis_name``.

    Call inside ``shard_map`` (or ``pmap``) after each device computed the gradient of its
    shard of the batch. Every device gets the same result, so a loss-scale finiteness check
    that runs after this reduction makes the same decision everywhere.

    Args:
      grads: pytree of floating arrays (other leaves are returned unchanged).
      axis_name: the data-parallel mesh axis (or axes).
      dtype: precision of the summation (``Policy.reduce_dtype``).
      comm_dtype: if set and different from ``dtype``, gradients travel in ``comm_dtype``
        (an ``all_gather``) and are summed locally in ``dtype``: "f32 accumulation with bf16
        communication". If None, a ``psum`` in ``dtype``.
      mean: divide by the number of devices (data-parallel averaging).

    Returns:
      The reduced gradients, in each leaf's original dtype.

    Example:
      Inside ``shard_map`` over the mesh axis "data" (one device here, the same code on 8),
      after ``g = jax.grad(loss)(params, local_batch)``:

      >>> import functools
      >>> from jax.sharding import Mesh, PartitionSpec as P
      >>> mesh = Mesh(jax.devices()[:1], ("data",))
      >>> @functools.partial(jax.shard_map, mesh=mesh, in_specs=P("data"), out_specs=P(),
      ...                    check_vma=False)
      ... def mean_grad(g):
      ...     return reduce_gradients({"w": g}, "data", comm_dtype="bf16")
      >>> mean_grad(jnp.full((4,), 0.5, jnp.float32))["w"]
      Array([0.5, 0.5, 0.5, 0.5], dtype=float32)
    """
    acc = _dtype(dtype, "dtype")
    comm = None if comm_dtype is None else _dtype(comm_dtype, "comm_dtype")

    def reduce(g: Any) -> Any:
        if not (hasattr(g, "dtype") and jnp.issubdtype(g.dtype, jnp.floating)):
            return g
        if comm is None or comm == acc:
            total = lax.psum(g.astype(acc), axis_name)
        else:
            parts = lax.all_gather(g.astype(comm), axis_name)  # [n, ...] in comm dtype
            total = jnp.sum(parts.astype(acc), axis=0)
        if mean:
            n = lax.psum(jnp.ones((), acc), axis_name)
            total = total / n
        return total.astype(g.dtype)

    return jax.tree.map(reduce, grads)


