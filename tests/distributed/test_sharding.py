"""fmtkit under JAX SPMD with 8 simulated CPU devices (one subprocess for all checks, so the
rest of the suite keeps its single device)."""

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("sharded_checks.py")


@functools.cache
def results() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True,
                         env=env, timeout=600)
    if out.returncode:
        pytest.fail(f"sharded checks failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # tens of seconds: trains or launches processes (make test-all runs it)
def test_jit_data_parallel_step_equals_single_device():
    # dynamic_loss_scale(master_weights(adamw)) on bf16 params; XLA's SPMD partitioner sums
    # the f32 partial products before anything is rounded, so the masters agree exactly.
    assert results()["jit_master_max_rel"] <= 2.0**-23


def test_bf16_mixed_data_parallel_gradients_match_to_bf16_rounding():
    r = results()
    assert r["bf16_mixed_grad_dtypes"] == ["float32"]  # gradients arrive in param dtype
    assert r["bf16_mixed_grad_rel"] < 2.0**-7  # bf16 matmul outputs, one rounding apart


def test_shard_map_reduction_equals_single_device_to_f32_roundoff():
    assert results()["shard_map_grad_max_rel"] < 1e-6  # 8 partial sums: a few f32 ulps


def test_overflow_on_one_device_makes_every_device_skip():
    r = results()
    assert r["poisoned_skipped_per_device"] == [1] * 8
    assert r["poisoned_params_unchanged"]
    assert r["poisoned_scale"] == 2.0**10 * 0.5  # one backoff from the initial 2^10


def test_fp8_delayed_history_equals_single_device():
    r = results()
    assert r["fp8_history_equal"] and r["fp8_history_nonzero"]


def test_fp8_delayed_observations_travel_in_one_all_reduce_per_step():
    # Once the histories hold a step, the quantization reads only the history, so XLA can
    # combine every dot's amax observation into one all-reduce at the end of the step: the
    # Mlp's two dots observe x and grad on batch shards (4 f32 maxima; w is replicated).
    r = results()
    assert r["fp8_observations"] == 6
    assert r["fp8_step_all_reduces"] == [1, 4 * 4]
    # vmapped over two members (seeds), one empty history: the members' maxima in one
    # all-reduce (the bootstrap stays a branch, not a select of both), each member updated
    # as on its own. 7 maxima: the input x is shared by the members, so its amax is too.
    assert r["fp8_vmapped_equal"]
    assert r["fp8_vmapped_all_reduces"] == [1, 7 * 4]


@pytest.mark.parametrize("recipe", ["delayed", "current"])
@pytest.mark.parametrize("history", ["empty", "recorded"])
def test_fp8_amax_reduce_axes_inside_shard_map_uses_the_global_amax(recipe, history):
    r, key = results(), f"fp8_reduce_axes_{recipe}_{history}"
    assert r[key + "_obs_exact"]
    # f32 summation order only; a shard-local amax would change the FP8 grid (about 2^-4).
    assert max(r[f"{key}_{part}_rel"] for part in ("y", "dx", "dw")) < 1e-6


def test_fsdp_sharding_survives_policy_cast_and_master_update():
    r = results()
    assert r["fsdp_param_sharding_kept"] and r["fsdp_master_sharding_matches"]


def test_bf16_reduction_is_measurably_worse_than_f32():
    r = results()
    # f32: a few ulps of f32; bf16 communication rounds every input once (~2^-9 relative);
    # a bf16 psum also rounds the partial sums, so it is the worst.
    assert r["reduce_err_f32"] < 1e-6
    assert r["reduce_err_bf16-comm"] > 100 * r["reduce_err_f32"]
    assert r["reduce_err_bf16"] > r["reduce_err_bf16-comm"]
