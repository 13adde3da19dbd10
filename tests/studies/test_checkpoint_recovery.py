"""Checkpoints that lose nothing: a write killed half-way, a truncated or corrupted
checkpoint, a checkpoint of another model (one process; the multi-process restarts, after
a kill mid-run and mid-write, are in ``test_multiprocess``)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

import studies.training as T
from studies.lib.models import TransformerConfig
from studies.training import checkpoint, distributed
from tests.studies.test_multiprocess import CFG, single

MICRO = TransformerConfig(d_model=32, num_heads=2, num_layers=1, d_ff=64, max_len=16)


def micro(**kw):
    base = dict(model=MICRO, batch=4, seq_len=16, steps=6, warmup=2, corpus_bytes=4096,
                checkpoint_every=2)
    return T.TrainConfig(**{**base, **kw})


class _Stop(Exception):
    pass


def _stop_after(n):
    def progress(it, total=None, desc=None):
        for k, i in enumerate(it):
            if k == n:
                raise _Stop
            yield i
    return progress


def _tree_digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _largest_file(folder: Path) -> Path:
    return max((p for p in folder.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


@pytest.mark.slow
def test_killed_write_leaves_the_previous_checkpoint(tmp_path):
    run = str(tmp_path / "run")
    base = {"setup": "bf16-master", "cfg": dict(CFG, steps=5, checkpoint_every=2)}
    clean = single("train", tmp_path / "clean", base, devices=1)
    with pytest.raises(pytest.fail.Exception, match="one process failed \\(-9\\)"):
        single("train", tmp_path / "killed", dict(base, run_dir=run, kill_in_write=4),
               devices=1)
    steps = sorted(p.name for p in (Path(run) / "checkpoints").iterdir())
    assert steps[0] == "2" and all(not s.startswith("4") or "tmp" in s for s in steps)
    resumed = single("train", tmp_path / "resumed", dict(base, run_dir=run, resume=True),
                     devices=1)
    assert resumed["resumed_from"] == 2
    assert resumed["fingerprint"] == clean["fingerprint"]
    assert resumed["history"] == clean["history"]


def test_corrupted_checkpoint_names_the_file_and_falls_back(tmp_path):
    cfg = micro()
    data = T.load_data(cfg)
    full = T.train("bf16-master", cfg, data=data)
    with pytest.raises(_Stop):
        T.train("bf16-master", cfg, _stop_after(5), run_dir=tmp_path, data=data)
    ckpts = tmp_path / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["2", "4"]
    victim = _largest_file(ckpts / "4" / "state")
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])  # truncated
    with pytest.warns(checkpoint.CheckpointWarning, match=str(ckpts / "4")):
        resumed = T.train("bf16-master", cfg, run_dir=tmp_path, resume=True, data=data)
    assert resumed.resumed_from == 2
    assert distributed.fingerprint(resumed.state) == distributed.fingerprint(full.state)
    assert resumed.history == full.history
    # The unreadable checkpoint is kept aside, and step 4 was written afresh.
    assert {"4", "4.unreadable", "6"} <= {p.name for p in ckpts.iterdir()}


def test_no_readable_checkpoint_is_a_clear_error(tmp_path):
    cfg = micro(steps=2)
    T.train("fp32", cfg, run_dir=tmp_path)
    victim = _largest_file(tmp_path / "checkpoints" / "2" / "state")
    victim.write_bytes(b"\x00garbage" * 3)
    with (pytest.warns(checkpoint.CheckpointWarning),
          pytest.raises(ValueError, match=r"no readable checkpoint in .*checkpoints.*2/state")):
        T.train("fp32", cfg, run_dir=tmp_path, resume=True)


def test_checkpoint_of_another_model_is_refused_and_left_alone(tmp_path):
    T.train("fp32", micro(steps=2), run_dir=tmp_path)
    before = _tree_digest(tmp_path)
    other = micro(steps=2, model=TransformerConfig(d_model=64, num_heads=2, num_layers=1,
                                                   d_ff=64, max_len=16))
    with pytest.raises(ValueError, match="different setup or config"):
        T.train("fp32", other, run_dir=tmp_path, resume=True)
    assert _tree_digest(tmp_path) == before  # nothing overwritten


def test_batch_not_divisible_by_the_mesh_is_a_clear_error():
    with pytest.raises(ValueError, match="batch=6 must be divisible by data_parallel=4"):
        micro(batch=6, data_parallel=4)
