"""The ``autopilot`` study end to end at a tiny size: which GEMMs move, when, and the FP8
FLOP share counted by hand from the model's shapes."""

import pytest

from studies import autopilot, runner
from studies.training.config import TrainConfig
from tests.studies.studies_testlib import assert_plots

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
                          (dict(d_model=128), "d_model")]:
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
