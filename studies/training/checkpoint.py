"""Orbax checkpoints of a run: the whole ``TrainState`` as a nested tree, and the history.

A checkpoint ``run_dir/checkpoints/<step>/`` holds two items: ``state``, the ``TrainState``
as orbax's standard pytree (a nested dict with the state's own keys:
``params/Block_0/.../kernel``, ``opt_state/...``, ``step``, ``rng``), and ``meta``
(JSON): the setup and config that wrote it and the metric history so far. A checkpoint only
restores into the run that wrote it (same setup and config; ``checkpoint_every`` may change).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import serialization

from studies.training.config import TrainConfig
from studies.training.setups import Setup
from studies.training.step import TrainState

__all__ = ["config_record", "open_manager", "restore", "save"]


def config_record(setup: Setup, cfg: TrainConfig) -> dict[str, Any]:
    """What a checkpoint must agree with to be resumed (checkpoint_every may change)."""
    c = dataclasses.asdict(cfg)
    c.pop("checkpoint_every")
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

    Raises:
      ValueError: the checkpoint was written by another setup or config.
    """
    import orbax.checkpoint as ocp

    step = mngr.latest_step()
    meta = mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    if meta.get("setup") != record["setup"] or meta.get("config") != record["config"]:
        raise ValueError(
            f"the checkpoint in {mngr.directory} was written by a different setup or config; "
            f"it has {meta.get('setup')} {meta.get('config')}, this run {record['setup']} "
            f"{record['config']}.")
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), _tree(template))
    out = mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract)))
    full = _fill(serialization.to_state_dict(template), out["state"])
    return serialization.from_state_dict(template, full), meta["history"]


def _fill(template: Any, restored: Any) -> Any:
    """``restored`` with the empty nodes ``_tree`` dropped put back from ``template``."""
    if isinstance(template, dict):
        return {k: _fill(v, restored[k]) if k in restored else v for k, v in template.items()}
    return restored
