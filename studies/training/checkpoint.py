"""Orbax checkpoints of a run: the whole ``TrainState`` as a nested tree, and the history.

A checkpoint ``run_dir/checkpoints/<step>/`` holds two items: ``state``, the ``TrainState``
as orbax's standard pytree (a nested dict with the state's own keys:
``params/Block_0/.../kernel``, ``opt_state/...``, ``step``, ``rng``), and ``meta``
(JSON): the setup and config that wrote it and the metric history so far. A checkpoint only
restores into the run that wrote it (same setup and config; ``checkpoint_every`` and
``data_parallel`` may change: the state is replicated, so a checkpoint written by N processes
restores onto any other number of processes or devices).

Nothing is lost: orbax writes a step into a temporary folder and renames it when every process
has finished (an interrupted write leaves no ``<step>`` folder, and the previous checkpoint
is the latest); under ``jax.distributed`` every process takes part in the same save and
restore. A checkpoint that cannot be read (truncated or corrupted files) is reported with its
path by a ``CheckpointWarning`` and the next older one is restored instead; when none is
readable, ``restore`` raises ``ValueError`` naming them. The unreadable ones are renamed
``<step>.unreadable`` (kept, not deleted) so that the resumed run can write those steps.
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import serialization

from studies.training.config import TrainConfig
from studies.training.setups import Setup
from studies.training.step import TrainState

__all__ = ["CheckpointWarning", "config_record", "open_manager", "restore", "save"]


class CheckpointWarning(UserWarning):
    """A checkpoint could not be read and an older one was restored instead."""


def config_record(setup: Setup, cfg: TrainConfig) -> dict[str, Any]:
    """What a checkpoint must agree with to be resumed (checkpoint_every may change)."""
    c = dataclasses.asdict(cfg)
    c.pop("checkpoint_every")
    c.pop("data_parallel")  # the state is replicated: any layout restores it
    return {"setup": repr(setup), "config": json.loads(json.dumps(c, default=str))}


def open_manager(run_dir: str | Path):
    """An ``orbax.checkpoint.CheckpointManager`` on ``run_dir/checkpoints`` (synchronous)."""
    import orbax.checkpoint as ocp

    options = ocp.CheckpointManagerOptions(enable_async_checkpointing=False, create=True)
    return ocp.CheckpointManager(Path(run_dir).absolute() / "checkpoints", options=options)


def _tree(state: Any) -> Any:
    """The state as nested dicts (NamedTuples by field, tuples by index), empty nodes
    dropped: orbax stores dicts of arrays and rejects empty containers."""
    def prune(node):
        if isinstance(node, dict):
            out = {k: prune(v) for k, v in node.items()}
            return {k: v for k, v in out.items() if not (isinstance(v, dict) and not v)}
        return node

    return prune(serialization.to_state_dict(state))


def save(mngr, state: TrainState, history: dict[str, list[float]], record: dict) -> None:
    """Saves ``state`` and ``{**record, "history": history}`` at step ``state.step``."""
    import orbax.checkpoint as ocp

    step = int(np.ravel(np.asarray(state.step))[0])  # a stacked (multi-seed) state: seed 0's
    mngr.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(_tree(state)),
        meta=ocp.args.JsonSave({**record, "history": history})), force=True)
    mngr.wait_until_finished()


def restore(mngr, template: TrainState, record: dict
            ) -> tuple[TrainState, dict[str, list[float]]]:
    """The latest checkpoint's state (structure, dtypes and shardings of ``template``) and
    history.

    Warns:
      CheckpointWarning: the latest checkpoint is unreadable (the message names it); the
        next older one is tried.

    Raises:
      ValueError: the checkpoint was written by another setup or config (nothing is
        written); no checkpoint is readable (the message names each and why).
    """
    import orbax.checkpoint as ocp

    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), _tree(template))
    failures = []
    for step in sorted(mngr.all_steps(), reverse=True):
        where = Path(mngr.directory) / str(step)
        try:
            meta = mngr.restore(step, args=ocp.args.Composite(
                meta=ocp.args.JsonRestore()))["meta"]
        except Exception as e:  # orbax and tensorstore raise many types
            failures.append(f"{where}/meta: {type(e).__name__}: {e}")
            warnings.warn(f"cannot read checkpoint {where}/meta ({type(e).__name__}: {e}); "
                          "trying the previous one.", CheckpointWarning, stacklevel=2)
            continue
        if meta.get("setup") != record["setup"] or meta.get("config") != record["config"]:
            raise ValueError(
                f"the checkpoint {where} was written by a different setup or config; it has "
                f"{meta.get('setup')} {meta.get('config')}, this run {record['setup']} "
                f"{record['config']}.")
        try:
            out = mngr.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract)))
            full = _fill(serialization.to_state_dict(template), out["state"])
            state = serialization.from_state_dict(template, full)
        except Exception as e:  # (as above)
            failures.append(f"{where}/state: {type(e).__name__}: {e}")
            warnings.warn(f"cannot read checkpoint {where}/state ({type(e).__name__}: {e}); "
                          "trying the previous one.", CheckpointWarning, stacklevel=2)
            continue
        if failures:
            _set_aside(mngr, [s for s in mngr.all_steps() if s > step])
        return state, meta["history"]
    raise ValueError(f"no readable checkpoint in {mngr.directory}: " + "; ".join(failures))


def _set_aside(mngr, steps: list[int]) -> None:
    """Renames the unreadable checkpoints ``<step>`` to ``<step>.unreadable`` (kept for
    inspection, no longer a step: the resumed run writes those steps afresh)."""
    if not steps:
        return
    if jax.process_index() == 0:
        for step in steps:
            src = Path(mngr.directory) / str(step)
            dst = src.with_name(f"{step}.unreadable")
            k = 1
            while dst.exists():
                dst = src.with_name(f"{step}.unreadable{k}")
                k += 1
            src.rename(dst)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("fmtkit-checkpoint-set-aside")
    mngr.reload()


def _fill(template: Any, restored: Any) -> Any:
    """``restored`` with the empty nodes ``_tree`` dropped put back from ``template``."""
    if isinstance(template, dict):
        return {k: _fill(v, restored[k]) if k in restored else v for k, v in template.items()}
    return restored
