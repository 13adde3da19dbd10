"""The data-parallel mesh: where the state and each batch live."""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

__all__ = ["batch_sharding", "data_mesh", "put_batch", "state_sharding"]


def data_mesh(n: int) -> Mesh:
    """A ``Mesh`` with one axis "data" over the first ``n`` local devices.

    Raises:
      ValueError: fewer than ``n`` local devices (the message says how to simulate them).
    """
    devices = jax.local_devices()
    if n > len(devices):
        raise ValueError(f"data_parallel={n} needs {n} local devices; this process has "
                         f"{len(devices)} ({devices[0].platform}). On CPU, set XLA_FLAGS="
                         f"--xla_force_host_platform_device_count={n} before starting.")
    return Mesh(np.array(devices[:n]), ("data",))


def state_sharding(n: int) -> jax.sharding.Sharding:
    """The train state's sharding: replicated over the mesh, or the first device for n = 1."""
    if n > 1:
        return NamedSharding(data_mesh(n), PartitionSpec())
    return SingleDeviceSharding(jax.local_devices()[0])


def batch_sharding(n: int) -> jax.sharding.Sharding:
    """A batch's sharding: split along its first axis over the mesh (one device for n = 1)."""
    if n > 1:
        return NamedSharding(data_mesh(n), PartitionSpec("data"))
    return SingleDeviceSharding(jax.local_devices()[0])


def put_batch(tokens: np.ndarray, n: int) -> jax.Array:
    """``tokens`` on the device(s), sharded along the batch over ``n`` devices."""
    return jax.device_put(tokens, batch_sharding(n))
