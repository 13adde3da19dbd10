"""Real multi-process runs (``jax.distributed`` over gloo on 127.0.0.1, ``studies.app.launch``):
training equals one process, precision state is the same on every process by construction,
checkpoints survive a SIGKILL.

Each test starts its processes through ``studies.app.launch`` (which kills every process when one
fails, and all of them after ``--timeout``) or ``subprocess.run(timeout=...)``.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from child_env import child_env

WORKER = Path(__file__).with_name("mp_worker.py")
ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 240  # seconds for one launch on a loaded 2-core machine (typically 20-45 s)

# The small LM, a few steps: 1 layer of d_model 128, 4 sequences of 16 bytes.
CFG = {"steps": 3, "batch": 4, "seq_len": 16, "corpus_bytes": 4096, "warmup": 1}


def _env(devices: int | None = None, fast_compile: bool = True) -> dict[str, str]:
    flags = () if devices is None else (f"--xla_force_host_platform_device_count={devices}",)
    return child_env(*flags, pythonpath=(ROOT,), fast_compile=fast_compile, drop=(
        "FMTKIT_NUM_PROCESSES", "FMTKIT_PROCESS_ID", "JAX_COORDINATOR_ADDRESS"))


def launch(mode: str, out: Path, args: dict, *, processes: int = 2, check: bool = True,
           fast_compile: bool = True) -> tuple[int, list[dict], str]:
    """Runs the worker as ``processes`` processes; returns the status, each one's JSON and
    the stderr."""
    out.mkdir(parents=True, exist_ok=True)
    for f in out.glob("p*.json"):
        f.unlink()
    cmd = [sys.executable, "-m", "studies.app.launch", "--num-processes", str(processes),
           "--timeout", str(TIMEOUT), "--", sys.executable, str(WORKER), mode, str(out),
           json.dumps(args)]
    r = subprocess.run(cmd, env=_env(fast_compile=fast_compile), capture_output=True, text=True,
                       timeout=TIMEOUT + 30, cwd=ROOT)
    if check and r.returncode:
        pytest.fail(f"{processes} processes failed ({r.returncode}):\n{r.stderr[-3000:]}")
    return r.returncode, [json.loads((out / f"p{i}.json").read_text())
                          for i in range(processes) if (out / f"p{i}.json").exists()], r.stderr


def single(mode: str, out: Path, args: dict, *, devices: int,
           fast_compile: bool = True) -> dict:
    """Runs the worker as one process with ``devices`` simulated CPU devices."""
    out.mkdir(parents=True, exist_ok=True)
    r = subprocess.run([sys.executable, str(WORKER), mode, str(out), json.dumps(args)],
                       env=_env(devices, fast_compile), capture_output=True, text=True,
                       timeout=TIMEOUT, cwd=ROOT)
    if r.returncode:
        pytest.fail(f"one process failed ({r.returncode}):\n{r.stderr[-3000:]}")
    return json.loads((out / "p0.json").read_text())


def _params(path: Path) -> dict[str, np.ndarray]:
    with np.load(path) as z:
        return {k: z[k] for k in z.files if k.startswith(".params")}


@pytest.mark.slow
def test_two_processes_train_like_one(tmp_path):
    args = {"setup": "fp32", "cfg": dict(CFG, data_parallel=2), "dump": True}
    # At the default compile level: the sums over shards below (tests/child_env.py).
    _, two, _ = launch("train", tmp_path / "two", args, fast_compile=False)
    one_2dev = single("train", tmp_path / "one2", args, devices=2, fast_compile=False)
    one_1dev = single("train", tmp_path / "one1", dict(args, cfg=dict(CFG, data_parallel=1)),
                      devices=1, fast_compile=False)
    # Every process holds the same state, bit for bit.
    assert two[0]["fingerprint"] == two[1]["fingerprint"]
    # Same partitioning (2 shards of 2 rows, partial sums then one 2-way all-reduce) in one
    # process with 2 devices: the same reduction order, so bit-identical.
    assert two[0]["fingerprint"] == one_2dev["fingerprint"]
    assert two[0]["history"] == one_2dev["history"]
    # One device sums the batch in another order (one reduction over 4 rows instead of two
    # partial sums of 2 added): f32 reduction-order rounding, not a different computation.
    # Step 0 sees identical parameters, so its loss is bit-identical; later losses differ by
    # the rounding of the earlier updates (relative 2^-17, 16 f32 ulps, bounds it here;
    # another batch would differ by ~1e-2).
    l2, l1 = np.array(two[0]["history"]["loss"]), np.array(one_1dev["history"]["loss"])
    assert l2[0] == l1[0]
    np.testing.assert_allclose(l2, l1, rtol=2.0**-17, atol=0)
    # AdamW moves an element by at most ~lr per step (|m_hat / sqrt(v_hat)| <= 1 for
    # clipped gradients), and a gradient element that is 0 in exact arithmetic may be a
    # rounding residue of either sign in one order and 0 in the other, which Adam
    # normalizes to a full step: the bound is 2 * sum of the learning rates (warmup 1 step
    # then cosine from 3e-3: steps 1, 2 have lr <= 3e-3).
    a, b = _params(tmp_path / "two" / "state0.npz"), _params(tmp_path / "one1" / "state0.npz")
    worst = max(float(np.max(np.abs(a[k].astype(np.float64) - b[k]))) for k in a)
    assert worst <= 2 * 2 * 3e-3


@pytest.mark.slow  # tens of seconds: trains or launches processes (make test-all runs it)
def test_inf_in_one_process_skips_everywhere(tmp_path):
    # fp16 compute, f32 masters, dynamic loss scale from 2^16; step 1 gets inf example
    # weights on the rows of process 1 only.
    args = {"cfg": dict(CFG, data_parallel=2), "inf_step": 1}
    _, res, _ = launch("inf", tmp_path, args)
    for r in res:
        rows = r["rows"]
        for row in rows:  # every process's fingerprint, gathered after every step
            assert len(row["fingerprints"]) == 2
            assert row["fingerprints"][0] == row["fingerprints"][1]
        assert [row["skipped"] for row in rows] == [0, 1, 1]
        # Backed off once (PyTorch GradScaler: x0.5), never grown (growth interval 2000).
        assert [row["loss_scale"] for row in rows] == [2.0**16, 2.0**15, 2.0**15]
        # The skipped step left params and masters as they were.
        assert rows[1]["params"] == rows[0]["params"]
        assert rows[2]["params"] != rows[1]["params"]
    assert res[0]["rows"] == res[1]["rows"]


def test_delayed_fp8_history_is_the_global_max(tmp_path):
    # Inputs in [-0.5, 0.5] plus one element per process: 3.0 on process 0, 7.0 on 1.
    _, res, _ = launch("fp8", tmp_path, {"amaxes": [3.0, 7.0]})
    assert res[0]["fingerprint"] == res[1]["fingerprint"]
    assert res[0]["fp8_state"] == res[1]["fp8_state"]
    (hist,) = [np.array(v) for v in res[0]["fp8_state"].values()]
    # Row 0: the input's amax history; one update recorded max(3.0, 7.0, |rest| <= 0.5).
    assert hist.shape[-2] == 3
    assert float(np.max(hist[..., 0, :])) == 7.0
    assert np.count_nonzero(hist[..., 0, :]) == 1


@pytest.mark.slow
def test_sigkill_mid_run_or_mid_write_then_restart_equals_uninterrupted(tmp_path):
    cfg = dict(CFG, steps=5, data_parallel=2, checkpoint_every=2)
    base = {"setup": "bf16-master", "cfg": cfg}
    _, clean, _ = launch("train", tmp_path / "clean", base)
    run = str(tmp_path / "run")
    # Process 1 SIGKILLs itself when it reaches step 3 (checkpoints at 2 exist): the
    # launcher stops process 0 too and reports the signal.
    code, _, _ = launch("train", tmp_path / "killed",
                        dict(base, run_dir=run, kill_at=[1, 3]), check=False)
    assert code != 0
    assert sorted(p.name for p in (Path(run) / "checkpoints").iterdir()
                  if p.name.isdigit()) == ["2"]
    copy = tmp_path / "copy"
    shutil.copytree(run, copy)
    _, resumed, _ = launch("train", tmp_path / "resumed", dict(base, run_dir=run, resume=True))
    for r in resumed:
        assert r["resumed_from"] == 2
        assert r["fingerprint"] == clean[0]["fingerprint"] == clean[1]["fingerprint"]
        assert r["history"] == clean[0]["history"]
    # The checkpoint of 2 processes restores onto 1 process with 2 devices (the state is
    # replicated; same partitioning, so still bit-identical).
    one = single("train", tmp_path / "one", dict(base, run_dir=str(copy), resume=True),
                 devices=2)
    assert one["resumed_from"] == 2
    assert one["fingerprint"] == clean[0]["fingerprint"]
    # SIGKILL inside the write of step 4's checkpoint (after its files, before orbax's
    # atomic rename): step 2 stays the latest, and a restart ends as the clean run.
    run = str(tmp_path / "run-write")
    code, _, _ = launch("train", tmp_path / "killed-write",
                        dict(base, run_dir=run, kill_in_write=4), check=False)
    assert code != 0
    assert sorted(p.name for p in (Path(run) / "checkpoints").iterdir()
                  if p.name.isdigit()) == ["2"]
    _, resumed, _ = launch("train", tmp_path / "resumed-write",
                           dict(base, run_dir=run, resume=True))
    for r in resumed:
        assert r["resumed_from"] == 2
        assert r["fingerprint"] == clean[0]["fingerprint"]


def test_process_count_not_matching_the_mesh_is_a_clear_error(tmp_path):
    run = tmp_path / "run"
    code, _, err = launch("train", tmp_path, {"setup": "fp32", "run_dir": str(run),
                                         "cfg": dict(CFG, data_parallel=1,
                                                     checkpoint_every=1)}, check=False)
    assert code != 0
    assert "data_parallel=1 must equal the number of devices of all 2 processes" in err
    assert not run.exists()  # nothing written


@pytest.mark.slow
def _ablate(out: Path, *, processes: int) -> dict:
    """``fmtkit ablate`` (fp32, 2 seeds, 2 steps) data-parallel over 2 devices: 2 processes
    of 1 device each, or 1 process with 2 simulated devices; its results.json."""
    args = ["ablate", "--policies", "fp32", "--seeds", "2", "--steps", "2", "--batch", "4",
            "--seq-len", "16", "--corpus-bytes", "4096", "--data-parallel", "2", "--warmup",
            "1", "--no-plot", "--out", str(out)]
    if processes > 1:
        cmd = [sys.executable, "-m", "studies.app.launch", "--num-processes", str(processes),
               "--timeout", str(TIMEOUT), "--", sys.executable, "-m", "studies.app.cli", *args]
        env = _env()
    else:
        cmd, env = [sys.executable, "-m", "studies.app.cli", *args], _env(devices=2)
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=TIMEOUT + 30,
                       cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("study ablate:") == 1  # printed by process 0 only
    (results,) = out.glob("ablate/*/results.json")  # one results folder
    return json.loads(results.read_text())["results"]


@pytest.mark.slow  # tens of seconds: trains or launches processes (make test-all runs it)
def test_ablate_under_the_launcher_writes_once_and_equals_one_process(tmp_path):
    """The seed-vmapped step sharded over a 2-process mesh: one results file, both seeds'
    numbers, equal to one process over 2 devices (the same mesh shape, so the same
    reduction order)."""
    two = _ablate(tmp_path / "two", processes=2)
    one = _ablate(tmp_path / "one", processes=1)
    (group,) = two["groups"]
    (row,) = group["rows"]
    assert row["setup"] == "fp32" and row["seeds"] == [0, 1]
    assert [p["steps_done"] for p in row["per_seed"]] == [2, 2]
    assert row["per_seed"][0]["final_loss"] != row["per_seed"][1]["final_loss"]
    np.testing.assert_array_equal(
        [p["history"]["loss"] for p in row["per_seed"]],
        [p["history"]["loss"] for p in one["groups"][0]["rows"][0]["per_seed"]])
