"""Several processes, one run: JAX's multi-controller runtime for the training library.

One process per host (or several on one machine, ``python -m studies.app.launch``), each running
the same program. ``initialize_from_env`` starts ``jax.distributed`` from three environment
variables (what the launcher sets; set them yourself on several hosts)::

    JAX_COORDINATOR_ADDRESS=host0:PORT   # process 0's host and a free port, same everywhere
    FMTKIT_NUM_PROCESSES=N               # number of processes
    FMTKIT_PROCESS_ID=i                  # 0 .. N-1, different on each process

Then the mesh spans every process's devices (``studies.training.mesh``), each process builds
only its own rows of the global batch (``put_global_batch``, via
``jax.make_array_from_process_local_data``) and the whole train step is one ``jit`` over
global arrays: the gradient is summed over all processes *inside* the step (an all-reduce
that XLA inserts), so the loss-scale skip decision, the loss-scale update, the delayed-FP8
amax (a max over the global batch), master weights and Kahan/stochastic-rounding state are
computed from the same global values on every process: identical by construction. Metrics,
progress and files come from process 0 only (``is_primary``); orbax checkpoints are written
by all processes together.

On CPU the collectives go through gloo (``jax_cpu_collectives_implementation``), so all of
this runs on one machine; on GPU/TPU hosts the same code uses NCCL/ICI.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

import jax
import numpy as np

__all__ = ["ENV_NUM_PROCESSES", "ENV_PROCESS_ID", "fingerprint", "gather_from_all",
           "initialize_from_env", "is_primary", "put_global_batch", "same_on_all"]

ENV_NUM_PROCESSES = "FMTKIT_NUM_PROCESSES"
"""Environment variable: the number of processes of a multi-process run."""
ENV_PROCESS_ID = "FMTKIT_PROCESS_ID"
"""Environment variable: this process's index, 0 .. N-1."""
ENV_COORDINATOR = "JAX_COORDINATOR_ADDRESS"
"""Environment variable (read by JAX itself too): ``host:port`` of process 0's coordinator."""


def initialize_from_env(environ: dict[str, str] | None = None) -> bool:
    """Starts ``jax.distributed`` when the environment names a multi-process run.

    An entry-point function (it sets ``jax_cpu_collectives_implementation`` to "gloo", which
    CPU collectives across processes need): call it before anything touches a device.

    Args:
      environ: the environment (default ``os.environ``).

    Returns:
      True when ``jax.distributed.initialize`` ran; False when ``FMTKIT_NUM_PROCESSES`` is
      unset (a single-process run; nothing is done).

    Raises:
      ValueError: a missing or malformed variable (the message names it and the allowed
        values).
    """
    env = os.environ if environ is None else environ
    if ENV_NUM_PROCESSES not in env:
        return False
    try:
        n = int(env[ENV_NUM_PROCESSES])
        i = int(env.get(ENV_PROCESS_ID, ""))
    except ValueError:
        raise ValueError(f"{ENV_NUM_PROCESSES} and {ENV_PROCESS_ID} must be integers, got "
                         f"{env.get(ENV_NUM_PROCESSES)!r} and {env.get(ENV_PROCESS_ID)!r}."
                         ) from None
    if n < 1 or not 0 <= i < n:
        raise ValueError(f"{ENV_NUM_PROCESSES} must be >= 1 and {ENV_PROCESS_ID} in "
                         f"0..{n - 1}, got {n} and {i}.")
    address = env.get(ENV_COORDINATOR)
    if not address or ":" not in address:
        raise ValueError(f"{ENV_COORDINATOR} must be host:port of process 0, got "
                         f"{address!r}.")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=address, num_processes=n, process_id=i)
    return True


def is_primary() -> bool:
    """True on process 0 (the one that prints, shows progress and writes result files)."""
    return jax.process_index() == 0


def put_global_batch(tokens: np.ndarray, sharding: jax.sharding.Sharding) -> jax.Array:
    """The global array ``tokens`` (the same on every process) as a global ``jax.Array``
    of ``sharding``, each process supplying only the block its devices hold
    (``jax.make_array_from_process_local_data``): the batch's rows, or with a leading
    seeds axis (``studies.training.multiseed``) the rows of every seed.

    Raises:
      ValueError: this process's part is not one contiguous block (a mesh whose device
        order interleaves processes).
    """
    index_map = sharding.addressable_devices_indices_map(tokens.shape)
    block = []
    for axis, size in enumerate(tokens.shape):
        spans = sorted({(s[axis].start or 0, size if s[axis].stop is None else s[axis].stop)
                        for s in index_map.values()})
        start, stop = spans[0][0], spans[-1][1]
        if sum(b - a for a, b in spans) != stop - start:
            raise ValueError(f"process {jax.process_index()} holds {spans} of axis {axis}: "
                             "not one contiguous block; order the mesh's devices by process.")
        block.append(slice(start, stop))
    return jax.make_array_from_process_local_data(sharding, tokens[tuple(block)],
                                                  tokens.shape)


def fingerprint(tree: Any) -> str:
    """A SHA-256 of every leaf's bytes, dtype and shape (this process's view of a replicated
    tree): equal fingerprints mean bit-identical trees."""
    h = hashlib.sha256()
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        a = np.asarray(jax.device_get(leaf))
        h.update(jax.tree_util.keystr(path).encode())
        h.update(str(a.dtype).encode() + str(a.shape).encode())
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def gather_from_all(text: str) -> list[str]:
    """``text`` from every process, in process order (a collective: all must call it)."""
    from jax.experimental import multihost_utils

    raw = np.frombuffer(text.encode(), np.uint8)
    if jax.process_count() == 1:
        return [text]
    size = int(np.max(multihost_utils.process_allgather(np.int32(raw.size))))
    padded = np.zeros(size, np.uint8)
    padded[:raw.size] = raw
    sizes = np.asarray(multihost_utils.process_allgather(np.int32(raw.size)))
    data = np.asarray(multihost_utils.process_allgather(padded))
    return [bytes(data[k, :sizes[k]]).decode() for k in range(jax.process_count())]


def same_on_all(value: int) -> int:
    """Process 0's ``value`` on every process (e.g. a timestamp naming a shared folder)."""
    if jax.process_count() == 1:
        return int(value)
    from jax.experimental import multihost_utils

    return int(multihost_utils.broadcast_one_to_all(np.int64(value)))
