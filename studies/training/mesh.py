"""The data-parallel mesh: where the state and each batch live.

In a single process the mesh is over the first ``n`` local devices. Under
``jax.distributed`` (several processes, ``studies.training.distributed``) it is over every
process's devices, in process order, and ``n`` must be that global device count: each process
feeds the rows of the batch its devices hold.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

from studies.training.distributed import put_global_batch

__all__ = ["batch_sharding", "data_mesh", "is_sharded", "put_batch", "replicate", "state_sharding"]


def data_mesh(n: int) -> Mesh:
    """A ``Mesh`` with one axis "data" over ``n`` devices (all processes' devices when
    there are several processes).

    Raises:
      ValueError: fewer than ``n`` local devices (the message says how to simulate them);
        several processes and ``n`` other than the global device count.
    """
    if jax.process_count() > 1:
        devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
        if n != len(devices):
            raise ValueError(
                f"data_parallel={n} must equal the number of devices of all "
                f"{jax.process_count()} processes together, {len(devices)} "
                f"({jax.local_device_count()} per process): the mesh spans every process.")
        return Mesh(np.array(devices), ("data",))
    devices = jax.local_devices()
    if n > len(devices):
        raise ValueError(f"data_parallel={n} needs {n} local devices; this process has "
                         f"{len(devices)} ({devices[0].platform}). On CPU, set XLA_FLAGS="
                         f"--xla_force_host_platform_device_count={n} before starting.")
    return Mesh(np.array(devices[:n]), ("data",))


def is_sharded(n: int) -> bool:
    """Whether a run over ``n`` devices has a mesh: n > 1, or several processes."""
    return n > 1 or jax.process_count() > 1


def state_sharding(n: int) -> jax.sharding.Sharding:
    """The train state's sharding: replicated over the mesh, or the first device for n = 1."""
    if is_sharded(n):
        return NamedSharding(data_mesh(n), PartitionSpec())
    return SingleDeviceSharding(jax.local_devices()[0])


def batch_sharding(n: int, *, seeds_axis: bool = False) -> jax.sharding.Sharding:
    """A batch's sharding: split along its batch axis over the mesh (one device for n = 1).

    Args:
      n: the data-parallel device count.
      seeds_axis: the batch has a leading seeds axis (``[seeds, batch, ...]``, the vmapped
        seeds of ``studies.training.multiseed``): every device holds all seeds, and its
        rows of each seed's batch.
    """
    if is_sharded(n):
        spec = PartitionSpec(None, "data") if seeds_axis else PartitionSpec("data")
        return NamedSharding(data_mesh(n), spec)
    return SingleDeviceSharding(jax.local_devices()[0])


def put_batch(tokens: np.ndarray, n: int, *, seeds_axis: bool = False) -> jax.Array:
    """``tokens`` (the global batch, ``[seeds, batch, ...]`` with ``seeds_axis``) on the
    device(s), sharded along the batch over ``n`` devices; with several processes each
    supplies only its own rows."""
    sharding = batch_sharding(n, seeds_axis=seeds_axis)
    if jax.process_count() > 1:
        return put_global_batch(tokens, sharding)
    return jax.device_put(tokens, sharding)


def replicate(tree: Any, n: int) -> Any:
    """``tree`` (the same on every process) placed as the train state is
    (``state_sharding(n)``): replicated over the mesh, so that a jitted function can mix it
    with the state's global arrays."""
    return jax.device_put(tree, state_sharding(n))
