"""A seeds axis: train several seeds of one setup in one compiled step (``jax.vmap``).

Error bars need several seeds per setup (``studies.stats``); running them one after the
other costs one compile each, or one process each. Here the seeds are a leading axis of the
train state and of the batch, and the step is ``jax.jit(jax.vmap(step_fn))``: one compile
serves every seed, and on a CPU or an accelerator the seeds share each kernel launch.

For a generic ``step_fn(state, batch) -> (state, metrics)`` (no I/O, as
``make_train_step`` returns):

* ``init_seeds(init_fn, seeds)``: ``init_fn(seed)`` for each seed (host-side, so it may use
  Python-level caches and ``PRNGKey(seed)`` as it does for one run), stacked on axis 0;
* ``vmap_step(step_fn)``: the jitted, vmapped step: ``(states[n], batches[n]) ->
  (states[n], metrics[n])``;
* ``run_seeds(init_fn, step_fn, batch_fn, seeds, steps)``: the loop; ``batch_fn(seed,
  step)`` gives each seed's own batch (e.g. the trainer's ``batch_at`` with that seed);
* ``stack`` / ``unstack``: between a list of per-seed pytrees and one stacked pytree (to
  save, resume or report each seed's state).

Semantics: seed i of the vmapped run computes what ``step_fn`` computes for seed i alone,
up to the reduction order XLA picks for batched and unbatched kernels (equal to f32 rounding,
tested). ``lax.cond`` inside the step (e.g. skipping a step on overflow) becomes a select
under ``vmap``: both branches run, each seed keeps its own decision. Anything the step
closes over is shared by all seeds: a seed baked into the optimizer as a Python constant
(e.g. a stochastic-rounding key from the config) must live in the state instead, or the
seeds share its random stream.

Measured with ``studies.train.make_train_step`` (tiny model, 3 seeds, the 2-core CPU, 20
steps): the vmapped seeds match separate runs to 1e-6 in loss for fp32; in low precision
the batched kernels' different rounding grows to 1.5e-4 (fp16 + dynamic scaling) and 3.5e-3
(FP8 delayed) after 20 steps, and ``pure-bf16-sr`` differed by 6e-4 when one seed's
optimizer state was used for all (the caveat above); ``studies.training.multiseed`` builds
each seed's state with its own stochastic-rounding seed (``StochasticRoundUpdatesState.seed``)
and matches separate runs to 2e-3 relative in loss over 6 steps (tested). A vmapped
step of 3 seeds costs about 3 single-seed steps on that CPU (no throughput gain there); the
saving is one compile per setup instead of one per seed (``make_train_step`` caches per
config, seed included: 20-40 s each on that machine under load).

Example:
  >>> import jax.numpy as jnp
  >>> init = lambda s: {"w": jnp.full((2,), float(s), jnp.float32)}
  >>> step = lambda st, b: ({"w": st["w"] - 0.5 * b}, {"w0": st["w"][0]})
  >>> batch = lambda s, t: np.ones(2, np.float32) * (s + t)
  >>> states, hist = run_seeds(init, step, batch, seeds=[0, 1], steps=2)
  >>> states["w"].tolist(), hist["w0"].tolist()
  ([[-0.5, -0.5], [-0.5, -0.5]], [[0.0, 0.0], [1.0, 0.5]])
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["init_seeds", "run_seeds", "stack", "unstack", "vmap_step"]


def _check_seeds(seeds: Sequence[int]) -> list[int]:
    seeds = list(seeds)
    if not seeds:
        raise ValueError("seeds must hold at least one seed.")
    for s in seeds:
        if isinstance(s, bool) or not isinstance(s, (int, np.integer)) or s < 0:
            raise ValueError(f"seeds must be ints >= 0, got {s!r}.")
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"seeds must be distinct (a repeated seed is not an independent "
                         f"run), got {seeds}.")
    return [int(s) for s in seeds]


def stack(trees: Sequence[Any]) -> Any:
    """Per-seed pytrees of one structure -> one pytree with a leading seeds axis."""
    if not trees:
        raise ValueError("stack needs at least one pytree.")
    return jax.tree.map(lambda *xs: jnp.stack(xs), *trees)


def unstack(tree: Any) -> list[Any]:
    """The inverse of ``stack``: a pytree with a leading seeds axis -> per-seed pytrees."""
    leaves, treedef = jax.tree.flatten(tree)
    n = leaves[0].shape[0]
    return [jax.tree.unflatten(treedef, [x[i] for x in leaves]) for i in range(n)]


def init_seeds(init_fn: Callable[[int], Any], seeds: Sequence[int]) -> Any:
    """``stack([init_fn(s) for s in seeds])``: each seed's initial state, stacked.

    Raises:
      ValueError: no seeds, a seed that is not an int >= 0, or a repeated seed.
    """
    return stack([init_fn(s) for s in _check_seeds(seeds)])


@functools.lru_cache(maxsize=32)
def vmap_step(step_fn: Callable[[Any, Any], tuple[Any, Any]], *,
              state_sharding: jax.sharding.Sharding | None = None,
              batch_sharding: jax.sharding.Sharding | None = None
              ) -> Callable[[Any, Any], tuple[Any, Any]]:
    """``jax.jit(jax.vmap(step_fn))``: one compiled step for every seed.

    Cached per ``step_fn`` (by identity) and shardings, so ``run_seeds`` called again with
    the same step (e.g. to resume) reuses the compiled step.

    Args:
      step_fn: ``(state, batch) -> (state, metrics)`` for one seed (pure; may be jitted
        already: ``vmap`` of a jitted function is fine, its shardings gain the seeds axis
        unsplit).
      state_sharding: with ``batch_sharding``, the stacked states' (and the metrics')
        sharding on a mesh, e.g. replicated: the seeds then run data-parallel, each
        seed's batch split over the devices (and processes) of the mesh.
      batch_sharding: the stacked batches' sharding (e.g. ``PartitionSpec(None, "data")``).

    Returns:
      ``(states, batches) -> (states, metrics)`` with a leading seeds axis on all of them.
    """
    if state_sharding is None and batch_sharding is None:
        return jax.jit(jax.vmap(step_fn))
    return jax.jit(jax.vmap(step_fn), in_shardings=(state_sharding, batch_sharding),
                   out_shardings=(state_sharding, state_sharding))


def run_seeds(init_fn: Callable[[int], Any], step_fn: Callable[[Any, Any], tuple[Any, Any]],
              batch_fn: Callable[[int, int], Any], seeds: Sequence[int], steps: int,
              *, states: Any = None, start: int = 0) -> tuple[Any, dict[str, np.ndarray]]:
    """Trains every seed for ``steps`` steps with one vmapped step.

    Args:
      init_fn: ``seed -> state`` (ignored when ``states`` is given).
      step_fn: ``(state, batch) -> (state, metrics)``, metrics a dict of scalars.
      batch_fn: ``(seed, step) -> batch`` (a NumPy or JAX array or pytree): each seed's
        own data order.
      seeds: distinct ints >= 0.
      steps: steps to run (>= 0).
      states: stacked states to continue from (e.g. restored from a checkpoint).
      start: the index of the first step (the ``step`` passed to ``batch_fn``).

    Returns:
      ``(states, history)``: the stacked final states and, per metric, a float64 array
      [seeds, steps].
    """
    seeds = _check_seeds(seeds)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ValueError(f"steps must be an int >= 0, got {steps!r}.")
    if states is None:
        states = init_seeds(init_fn, seeds)
    step = vmap_step(step_fn)
    rows: list[dict[str, Any]] = []
    for t in range(start, start + steps):
        batches = stack([jax.tree.map(jnp.asarray, batch_fn(s, t)) for s in seeds])
        states, metrics = step(states, batches)
        rows.append(metrics)
    history: dict[str, np.ndarray] = {}
    if rows:
        fetched = jax.device_get(rows)
        for k in fetched[0]:
            history[k] = np.stack([np.asarray(r[k], np.float64) for r in fetched], axis=1)
    return states, history
