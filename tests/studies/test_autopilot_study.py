"""The ``autopilot`` study end to end at a tiny size: which GEMMs move, when, and the FP8
FLOP share counted by hand from the model's shapes."""

import json

import jax
import numpy as np
import pytest

from studies.app import runner
from studies.lm import autopilot
from studies.training.config import TrainConfig
from tests.studies.studies_testlib import Interrupted, assert_plots

# batch 2 x 16 tokens = 32 rows; d_model 256, d_ff 512, 4 heads of 64, vocab 256.
N, D, F, T, B, H = 32, 256, 512, 16, 2, 4
PROJ = 2 * N * D * D  # query, key, value, out, head
MLP = 2 * N * D * F  # Dense_0, Dense_1
ATTN = 2 * B * H * T * T * (D // H)  # scores and the weighted sum, each
TOTAL = 5 * PROJ + 2 * MLP + 2 * ATTN
READERS = ["Block_0/MlpBlock_0/Dense_0", "Block_0/attn/key", "Block_0/attn/query",
           "Block_0/attn/value"]


def test_registered_and_bad_values_rejected():
    assert "autopilot" in runner.STUDIES
    runner.load("autopilot")
    for kwargs, match in [(dict(magnitude=0.5), "magnitude"),
                          (dict(underflow_share=2.0), "underflow_share"),
                          (dict(patience=0), "patience"), (dict(freq=0), "freq"),
                          (dict(tensors=("output",)), "tensors"),
                          (dict(d_model=128), "d_model"),
                          (dict(ladder=("blockwise", "bf16")), "ladder"),
                          (dict(resume="/nonexistent/run"), "no such folder")]:
        with pytest.raises(ValueError, match=match):
            autopilot.Config(**kwargs)


@pytest.mark.slow  # six short runs of the 256-wide one-block model
def test_autopilot_moves_the_outlier_readers_and_counts_fp8_flops(tmp_path):
    cfg = autopilot.Config(
        magnitude=1e6, ramp_start=0, ramp_steps=0, patience=1, freq=1,
        train=TrainConfig(steps=3, seeds=2, batch=2, seq_len=16, warmup=1,
                          corpus_bytes=4096))
    res = autopilot.run(cfg)
    for r in res["arms"]["autopilot"]:
        # At 1e6 the per-tensor scale flushes the normal channels of the norm outputs: the
        # four GEMMs that read them move at step 0, the others (out, Dense_1) stay in FP8.
        assert sorted(d["module"] for d in r["decisions"]) == READERS
        assert {(d["step"], d["gemm"], d["tensor"], d["stat"]) for d in r["decisions"]} == {
            (0, "dot_general_0", "activation", "underflow_share")}
        assert all(d["value"] > 0.5 for d in r["decisions"])
        assert r["compilations"] == 2
        # In FP8: the four readers for 1 step of 3, out and Dense_1 for all 3.
        assert r["fp8_flop_share"] == pytest.approx(
            (3 * (PROJ + MLP) + (3 * PROJ + MLP)) / (3 * TOTAL), rel=1e-12)
    assert res["fp8_flop_share"]["fp8-current"] == pytest.approx(
        (4 * PROJ + 2 * MLP) / TOTAL, rel=1e-12)
    assert res["fp8_flop_share"]["bf16-mixed"] == 0.0
    assert set(res["gaps"]) == {"fp8-current", "autopilot"}
    text = autopilot.summarize(res)
    assert "autopilot" in text and "FP8 FLOP share" in text
    assert_plots(autopilot.plot(res, tmp_path))


def _progress_counting(counts, kill_at=None):
    """A progress factory that records how many steps each run iterates and, with
    ``kill_at``, raises ``Interrupted`` before the study's ``kill_at``-th step (counted over
    all its runs): a study killed there."""
    def progress(iterable, *, total=None, desc=None):
        counts[desc] = 0
        for item in iterable:
            if kill_at is not None and sum(counts.values()) == kill_at:
                raise Interrupted
            counts[desc] += 1
            yield item

    return progress


@pytest.mark.slow  # three arms of the 256-wide one-block model, run one and a half times
def test_a_killed_study_resumes_bit_for_bit(tmp_path):
    # The outlier from step 1: the readers cross at steps 1 and 2 per tensor (-> blockwise,
    # decided at 2), and at 3 and 4 blockwise (the outlier's tile) -> compute, decided at 4.
    def config(folder, resume=None):
        return autopilot.Config(
            magnitude=1e6, ramp_start=1, ramp_steps=0, patience=2, freq=1,
            ladder=("blockwise", "compute"), checkpoint_dir=str(folder), resume=resume,
            train=TrainConfig(steps=6, seeds=1, batch=2, seq_len=16, warmup=1,
                              corpus_bytes=4096, checkpoint_every=3))

    full = autopilot.run(config(tmp_path / "full"))
    got = [(d["step"], d["setting"]) for d in full["arms"]["autopilot"][0]["decisions"]]
    assert got == [(2, "blockwise")] * 4 + [(4, "compute")] * 4
    # Blockwise is FP8: the readers leave FP8 after step 4 (5 of 6 steps), out and Dense_1
    # stay for all 6.
    assert full["fp8_flop_share"]["autopilot"] == pytest.approx(
        (5 * (3 * PROJ + MLP) + 6 * (PROJ + MLP)) / (6 * TOTAL), rel=1e-12)
    # Killed before the autopilot arm's step 4 (the other arms have finished): its latest
    # checkpoint is at step 3, after the move to blockwise and before the move to compute.
    counts = {}
    with pytest.raises(Interrupted):
        autopilot.run(config(tmp_path / "killed"), _progress_counting(counts, kill_at=16))
    assert list(counts.values()) == [6, 6, 4]
    (folder,) = (tmp_path / "killed").iterdir()
    counts = {}
    resumed = autopilot.run(config(tmp_path / "unused", resume=str(folder)),
                            _progress_counting(counts))
    # The finished runs are read back, the autopilot run continues from step 3.
    assert list(counts.values()) == [0, 0, 3]
    assert not (tmp_path / "unused").exists()
    for key in ("wall_seconds", "checkpoint_dir"):
        full.pop(key), resumed.pop(key)
    # Losses, decisions, compilations, FLOP shares, gaps (JSON: NaN, one seed's std, equal).
    assert json.dumps(resumed, sort_keys=True) == json.dumps(full, sort_keys=True)
    for arm in autopilot.ARMS:
        assert resumed["arms"][arm][0]["losses"] == full["arms"][arm][0]["losses"]
    assert resumed["arms"]["autopilot"][0]["compilations"] == 3
    # The final states (parameters and optimizer states) too.
    import orbax.checkpoint as ocp

    for arm in autopilot.ARMS:
        a, b = (ocp.StandardCheckpointer().restore(
            (root / arm / "seed0" / "checkpoints" / "6" / "state").absolute())
            for root in (next((tmp_path / "full").iterdir()), folder))
        la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
        assert len(la) == len(lb) > 0
        assert all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(la, lb))


def test_gemm_flops_counts_a_grouped_gemm_row_by_row():
    import flax.linen as nn
    import jax.numpy as jnp

    from fmtkit.policy import with_policy

    class MoE(nn.Module):
        @nn.compact
        def __call__(self, x):
            w = self.param("experts", nn.initializers.normal(), (4, 128, 256))
            h = jax.lax.ragged_dot(x, w, jnp.array([8, 0, 16, 8], jnp.int32))
            return nn.Dense(8, name="head")(h)

    x = jnp.ones((32, 128))
    model = MoE()
    flops = autopilot.gemm_flops(with_policy(model, "fp8-current"),
                                 model.init(jax.random.key(0), x), x)
    # 32 tokens x 128 inputs x 256 outputs, each token through one expert (2 FLOPs per MAC).
    assert flops["/ragged_dot_general_0"] == (2.0 * 32 * 128 * 256, True)
    assert flops["head/dot_general_0"] == (2.0 * 32 * 256 * 8, False)
