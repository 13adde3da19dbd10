"""studies.training.loop: one trace per run, bit-identical resume, what master weights buy,
bad input.

The model here is a micro transformer (d_model 32, one layer) so that each compile takes a
couple of seconds; the properties tested do not depend on the size.
"""

import math
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from studies_testlib import Interrupted, stop_after

from fmtkit import optim
from studies import training as T
from studies.lib.common import StudyError
from studies.lib.models import TransformerConfig
from studies.training import checkpoint, metrics, step

MICRO = TransformerConfig(d_model=32, num_heads=2, num_layers=1, d_ff=64, max_len=16)


def micro(**kw):
    base = dict(model=MICRO, batch=4, seq_len=16, steps=6, warmup=2, corpus_bytes=4096)
    return T.TrainConfig(**{**base, **kw})


def _bits_equal(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype.kind == "f" or a.dtype in (np.dtype(ml_dtypes.bfloat16),):
        a = a.view(f"u{a.dtype.itemsize}")
        b = b.view(f"u{b.dtype.itemsize}")
    return bool(np.array_equal(a, b))


def _assert_states_identical(s1, s2):
    l1, t1 = jax.tree.flatten(s1)
    l2, t2 = jax.tree.flatten(s2)
    assert t1 == t2
    assert len(l1) == len(l2) > 0
    for i, (a, b) in enumerate(zip(l1, l2)):
        assert _bits_equal(a, b), f"leaf {i} differs: {a!r} vs {b!r}"


# fp16 parameters and compute, f32 master weights and dynamic loss scaling. An initial scale
# of 2^20 makes the fp16 weight gradients (sums over 60 tokens of scaled cotangents) overflow
# fp16 (max 65504), so the run skips steps and backs the scale off; growth every 2 finite
# steps moves it again: all of that state has to survive a checkpoint.
SCALED_MASTER = T.Setup(
    "fp16-master-dynamic", "p=f16,c=f16,o=f16,g=f16", update="master",
    loss_scaling="dynamic", init_scale=2.0**20, growth_interval=2, grad_format="float16",
    description="fp16 params and compute, f32 masters, dynamic loss scaling")
RESUME_CFG = micro(steps=6, checkpoint_every=3)


# ------------------------------------------------------------------------------ tracing


def test_train_step_traces_once_over_three_calls(monkeypatch):
    traces = []
    real = step.lm_loss

    def counting_loss(logits, tokens):  # runs once per trace of the step, never when cached
        traces.append(1)
        return real(logits, tokens)

    monkeypatch.setattr(step, "lm_loss", counting_loss)
    init_fn, step_fn = T.make_train_step(SCALED_MASTER, RESUME_CFG)
    state = init_fn()
    data = T.load_data(RESUME_CFG)
    scales = []
    for k in range(3):  # the state evolves (step, moments, loss scale, amaxes), batches change
        state, metrics = step_fn(state, jnp.asarray(T.batch_at(data, RESUME_CFG, k)))
        scales.append(float(metrics["loss_scale"]))
    assert len(traces) == 1
    assert int(state.step) == 3
    assert len(set(scales)) >= 2  # a value that changes per step really is not static


def test_checkpoint_round_trips_every_leaf_of_the_state(tmp_path):
    # bf16 params, f32 masters, loss scale and counters, FP8 delayed amax histories, the rng:
    # every leaf perturbed away from its initial value, saved with orbax, restored exactly.
    setup = T.Setup("bf16-fp8delayed-master-dynamic", "p=bf16,c=bf16,fp8=delayed",
                    update="master", loss_scaling="dynamic")
    state = T.make_train_step(setup, RESUME_CFG)[0]()
    dtypes = {x.dtype for x in jax.tree.leaves(state)}
    assert {jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32), jnp.dtype(jnp.int32),
            jnp.dtype(jnp.uint32)} <= dtypes
    assert jax.tree.leaves(state.fp8_state)
    rng = np.random.default_rng(0)

    def perturb(x):
        if jnp.issubdtype(x.dtype, jnp.floating):
            noise = rng.standard_normal(x.shape).astype(np.float32)
            return (x.astype(jnp.float32) + noise).astype(x.dtype)
        return x + jnp.asarray(rng.integers(1, 100, x.shape), x.dtype)

    state = jax.tree.map(perturb, state)
    record = checkpoint.config_record(setup, RESUME_CFG)
    mngr = checkpoint.open_manager(tmp_path)
    history = {k: [0.5, float("nan")] for k in T.METRIC_KEYS}
    checkpoint.save(mngr, state, history, record)
    # Structured: the state's own keys, not numbered leaves.
    saved = mngr.item_metadata(mngr.latest_step())["state"]
    saved = getattr(saved, "tree", saved)
    assert set(saved) == {"params", "opt_state", "fp8_state", "step", "rng"}
    assert saved["params"]["head"]["kernel"].shape == state.params["head"]["kernel"].shape
    back, back_history = checkpoint.restore(mngr, T.make_train_step(setup, RESUME_CFG)[0](),
                                            record)
    mngr.close()
    _assert_states_identical(state, back)
    np.testing.assert_array_equal(back_history["loss"], [0.5, float("nan")])


def test_batches_depend_only_on_seed_and_step():
    cfg = micro()
    data = T.load_data(cfg)
    b5 = T.batch_at(data, cfg, 5)
    assert b5.dtype == np.int32 and b5.shape == (cfg.batch, cfg.seq_len)
    assert np.array_equal(b5, T.batch_at(data, cfg, 5))  # asked again, later: same batch
    assert not np.array_equal(b5, T.batch_at(data, cfg, 6))
    # Every row is a contiguous slice of the corpus.
    raw = bytes(data)
    for row in b5:
        assert bytes(row.astype(np.uint8)) in raw


# ------------------------------------------------------------------------------ resume




@pytest.mark.slow  # three runs with checkpoints
def test_resume_is_bit_identical_to_an_uninterrupted_run(tmp_path):
    cfg = RESUME_CFG
    data = T.load_data(cfg)
    fns = T.make_train_step(SCALED_MASTER, cfg)  # one compile for the three runs
    full = T.train(SCALED_MASTER, cfg, data=data, step=fns)  # uninterrupted, no checkpoints

    with pytest.raises(Interrupted):  # "killed" after 3 steps (a checkpoint at step 3)
        T.train(SCALED_MASTER, cfg, stop_after(3), run_dir=tmp_path, data=data, step=fns)
    resumed = T.train(SCALED_MASTER, cfg, run_dir=tmp_path, resume=True, data=data, step=fns)

    assert resumed.resumed_from == 3
    assert resumed.steps_done == full.steps_done == 6
    _assert_states_identical(full.state, resumed.state)
    for key in T.METRIC_KEYS:  # NaN == NaN here (a skipped step's gradient norm is NaN/inf)
        np.testing.assert_array_equal(resumed.history[key], full.history[key], err_msg=key)
    # The state that had to come back was really there: skipped and applied steps, a scale
    # that moved, masters in the optimizer state, amax histories.
    assert 1 <= sum(full.history["skipped"]) <= 5
    assert len(set(full.history["loss_scale"])) >= 2
    masters = [s for s in jax.tree.leaves(
        full.state.opt_state, is_leaf=lambda x: isinstance(x, optim.MasterWeightsState))
        if isinstance(s, optim.MasterWeightsState)]
    assert len(masters) == 1

    # A checkpoint only resumes the run that wrote it.
    with pytest.raises(ValueError, match="different setup or config"):
        T.train(SCALED_MASTER, micro(steps=6, checkpoint_every=3, lr=1e-4), run_dir=tmp_path,
                resume=True, data=data)


# ------------------------------------------------------------------------------ numerics


@pytest.mark.slow  # two training runs
def test_master_weights_move_bf16_parameters_that_pure_bf16_cannot():
    # Adam's step is bounded by the learning rate: |update| <= lr when 1 - b1 <= sqrt(1 - b2)
    # (Kingma & Ba 2015, section 2.1; b1 = 0.9, b2 = 0.95 here), and the schedule never
    # exceeds the peak lr. A bf16 value p changes under p + u only if |u| >= ulp(p) / 2,
    # ulp(p) = 2^(floor(log2 |p|) - 7) (8 significant bits). So every bf16 parameter whose
    # half-ulp exceeds 2 * lr (a factor 2 of margin for the bf16 moments and update) is frozen
    # in pure-bf16, at every step. With f32 masters the same updates accumulate and cross it.
    lr = 2.0**-14
    cfg = micro(steps=8, lr=lr, warmup=0, weight_decay=0.0, clip_norm=0.0)
    pure = T.train("pure-bf16", cfg)
    master = T.train("bf16-master", cfg)
    init = T.make_train_step("pure-bf16", cfg)[0]().params

    p0 = np.concatenate([np.asarray(x, np.float32).ravel() for x in jax.tree.leaves(init)])
    p_pure = np.concatenate([np.asarray(x, np.float32).ravel()
                             for x in jax.tree.leaves(pure.state.params)])
    p_master = np.concatenate([np.asarray(x, np.float32).ravel()
                               for x in jax.tree.leaves(master.state.params)])
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(master.state.params))
    nonzero = p0 != 0
    half_ulp = np.zeros(p0.shape)
    half_ulp[nonzero] = np.exp2(np.floor(np.log2(np.abs(p0[nonzero].astype(np.float64)))) - 7) / 2
    frozen = nonzero & (half_ulp > 2 * lr)
    assert frozen.mean() > 0.5  # most weights are that large at this learning rate
    assert np.array_equal(p_pure[frozen], p0[frozen])  # exactly unchanged: updates vanished
    moved = np.mean(p_master[frozen] != p0[frozen])
    assert moved > 0.03, moved  # the masters carried the small updates across the threshold
    # The per-step metric agrees with a count from the states: pure-bf16's updates changed
    # fewer elements than the master version's.
    assert np.mean(pure.history["update_frac"]) < np.mean(master.history["update_frac"])


def test_fp16_grad_flush_counts_values_below_half_the_smallest_subnormal():
    # The metric is defined against the fp16 format: values with |g| < 2^-25 flush.
    g = {"a": jnp.array([2.0**-26, 2.0**-20, 0.0, 1.0], jnp.float32),
         "b": jnp.array([-(2.0**-30), 3e-8], jnp.float32)}
    nonzero, flushed = metrics.flush_counts(g, "float16")
    # nonzero: 5 values; flushed: 2^-26 and -2^-30 (3e-8 > 2^-25 = 2.98e-8 rounds to 2^-24)
    assert float(nonzero) == 5.0 and float(flushed) == 2.0


def test_non_finite_loss_marks_a_divergent_setup_and_stops_any_other():
    cfg = micro(steps=4, lr=1e30, warmup=0, clip_norm=0.0)  # the first update blows up
    may = T.Setup("fp32-may-diverge", "fp32", may_diverge=True)
    fns = T.make_train_step("fp32", cfg)  # the same step: only the reaction differs
    result = T.train(may, cfg, step=fns)
    assert result.diverged and result.diverged_at == 1
    assert math.isfinite(result.history["loss"][0])
    assert not math.isfinite(result.history["loss"][-1])
    assert math.isnan(result.final_loss)
    with pytest.raises(StudyError, match=r"loss is .* at step 1 under setup 'fp32'"):
        T.train("fp32", cfg, step=fns)


# ------------------------------------------------------------------------------ bad input


def test_bad_configs_and_names_raise_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="steps must be >= 1"):
        T.TrainConfig(steps=0)
    with pytest.raises(ValueError, match="model_size must be one of tiny, small, base"):
        T.TrainConfig(model_size="huge")
    with pytest.raises(ValueError, match="divisible by data_parallel"):
        T.TrainConfig(batch=6, data_parallel=4)
    with pytest.raises(TypeError, match="lr must be a finite number"):
        T.TrainConfig(lr=float("nan"))
    with pytest.raises(ValueError, match="valid: fp32, bf16-mixed"):
        T.get_setup("fp64")
    with pytest.raises(ValueError, match="needs 2 local devices"):
        T.make_train_step("fp32", micro(data_parallel=2))
    with pytest.raises(ValueError, match="resume=True needs run_dir"):
        T.train("fp32", micro(), resume=True)
    with pytest.raises(FileNotFoundError):
        T.load_data(micro(data=str(tmp_path / "missing.txt")))
    short = tmp_path / "short.txt"
    short.write_text("abc")
    with pytest.raises(ValueError, match="fewer than seq_len=16"):
        T.load_data(micro(data=str(short)))


_DATA_PARALLEL_SCRIPT = """
import json
import numpy as np
from fmtkit import optim
from studies import training as T
from studies.training import checkpoint, metrics, step
from studies.lib.models import TransformerConfig
model = TransformerConfig(d_model=32, num_heads=2, num_layers=1, d_ff=64, max_len=16)
cfg = dict(model=model, batch=4, seq_len=16, steps=3, warmup=1, corpus_bytes=4096)
one = T.train("fp32", T.TrainConfig(**cfg))
two = T.train("fp32", T.TrainConfig(**cfg, data_parallel=2))
spec = two.state.params["head"]["kernel"].sharding
print(json.dumps({"one": one.history["loss"], "two": two.history["loss"],
                  "devices": len(spec.device_set)}))
"""


@pytest.mark.slow  # a fresh process, two runs
def test_data_parallel_over_two_devices_matches_one_device():
    # A fresh process: the device count is fixed when JAX starts.
    import json
    import os
    import subprocess
    import sys

    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_allow_excess_precision=false"
                        " --xla_force_host_platform_device_count=2").strip()
    root = Path(__file__).resolve().parents[2]  # the repository: `studies` imports from it
    out = subprocess.run([sys.executable, "-c", _DATA_PARALLEL_SCRIPT], env=env, cwd=root,
                         capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["devices"] == 2  # the state really lives on the 2-device mesh
    # Same model, same batches; only the order of the f32 reductions over the batch differs
    # (two shards of 2 sequences): the losses agree to a few f32 ulps (2^-23 = 1.2e-7
    # relative each; 1e-5 leaves room for 3 steps of Adam amplifying them).
    np.testing.assert_allclose(res["two"], res["one"], rtol=1e-5)
