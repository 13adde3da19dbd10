"""fmtkit.debug.log: the TensorBoard files and JSON lines hold exactly the statistics given.

The event files are read back with TensorBoard's own reader (``EventAccumulator`` from the
``tensorboard`` package, independent of tensorboardX that writes them); the expected tags and
values are built here with plain Python from the synthetic statistics dict. Per-shard
reductions are checked against NumPy float64 statistics of the whole tensor (the exact rules)
or against their bound (the rules that are not exact).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from child_env import child_env
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from fmtkit.debug import log as dlog
from fmtkit.debug.log import REDUCTIONS, StatsLogger, flatten_stats, reduce_stat, split_tag

NAN = float("nan")
INF = float("inf")


def synthetic(step: int) -> dict:
    """A stats pytree: a root GEMM, nested module paths, an exact quantization (inf SQNR)."""
    s = float(step)
    return {
        "": {"dot_general_0": {"activation": {"amax": 1.0 + s, "min": -2.0 * s},
                               "dgrad": {"std": 0.25 * s}}},
        "Block_0/MlpBlock_0/Dense_1": {
            "dot_general_0": {"activation": {"underflow_share": 0.01 * s, "sqnr_db": 30.0 - s},
                              "weight": {"sqnr_db": INF, "amax": 3.5}},
            "dot_general_1": {"output_grad": {"saturation_share": 0.5 / (1 + s),
                                              "nonfinite_count": s}},
        },
        "Dense_0": {"conv_general_dilated_0": {"wgrad": {"l2_norm": np.float32(2.5) * s}}},
    }


def expected_flat(stats: dict) -> dict[str, float]:
    """{tag: value} by hand: the root module's tags have no leading "/"; NaN dropped."""
    out = {}
    for module, gemms in stats.items():
        for gemm, tensors in gemms.items():
            for tensor, entries in tensors.items():
                for stat, v in entries.items():
                    v = float(v)
                    if v == v:
                        tag = f"{module}/{gemm}/{tensor}/{stat}" if module else (
                            f"{gemm}/{tensor}/{stat}")
                        out[tag] = v
    return out


def read_tensorboard(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)]
            for tag in acc.Tags()["scalars"]}


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def mismatches(logdir: Path, steps) -> list[str]:
    """Where the event files and stats.jsonl differ from ``synthetic`` at ``steps`` ([]: none)."""
    problems = []
    tb = read_tensorboard(logdir)
    want = {s: expected_flat(synthetic(s)) for s in steps}
    if set(tb) != set(want[steps[0]]):
        problems.append(f"tensorboard tags {sorted(set(tb) ^ set(want[steps[0]]))}")
    for tag, events in tb.items():
        if [s for s, _ in events] != list(steps):
            problems.append(f"tensorboard steps of {tag}")
        for s, v in events:
            # TensorBoard stores scalars as float32.
            if tag not in want[s] or v != float(np.float32(want[s][tag])):
                problems.append(f"tensorboard {tag} at {s}: {v}")
    lines = read_jsonl(logdir / "stats.jsonl")
    if [rec["step"] for rec in lines] != list(steps):
        problems.append("jsonl steps")
    for rec in lines:
        if rec["stats"] != want[rec["step"]]:  # float64, exact
            problems.append(f"jsonl at {rec['step']}")
    return problems


def _write_run(logdir: Path, steps, breakage=None) -> None:
    """Writes ``synthetic`` at ``steps``, each step's statistics changed by ``breakage`` first
    (None: as they are)."""
    nan_step = {m: {g: {t: dict.fromkeys(e, NAN) for t, e in ts.items()}
                    for g, ts in gs.items()} for m, gs in synthetic(0).items()}
    with StatsLogger(logdir) as log:
        for step in steps:
            stats = synthetic(step) if breakage is None else breakage(synthetic(step))
            assert log.write(step, stats) == len(expected_flat(synthetic(step)))
            # A step that does not log holds NaN everywhere: nothing is written.
            assert log.write(step + 5, nan_step) == 0


def test_tensorboard_and_jsonl_hold_every_tag_and_value(tmp_path):
    steps = (0, 10, 20)
    _write_run(tmp_path, steps)
    assert mismatches(tmp_path, steps) == []
    tags = read_tensorboard(tmp_path)
    assert "Block_0/MlpBlock_0/Dense_1/dot_general_0/activation/underflow_share" in tags
    assert "dot_general_0/activation/amax" in tags  # root module: no leading "/"
    [rec] = [r for r in read_jsonl(tmp_path / "stats.jsonl") if r["step"] == 10]
    assert rec["stats"]["Block_0/MlpBlock_0/Dense_1/dot_general_0/weight/sqnr_db"] == INF


@pytest.mark.parametrize("breakage", ["tag", "value"])
def test_the_readback_check_sees_a_broken_writer(tmp_path, breakage):
    """Negative control: files whose tags have two components swapped (the GEMM name and the
    tensor) or whose values are one float32 ulp off are caught by ``mismatches``. The files
    are written from statistics changed so (what a writer with either fault would write)."""
    if breakage == "tag":
        def broken(stats):  # {m: {g: {t: ...}}} -> {m: {t: {g: ...}}}: tags "m/t/g/s"
            out = {}
            for m, gs in stats.items():
                for g, ts in gs.items():
                    for t, entries in ts.items():
                        out.setdefault(m, {}).setdefault(t, {})[g] = entries
            return out
    else:
        def broken(stats):
            return {m: {g: {t: {s: float(np.nextafter(np.float32(v), np.float32(np.inf)))
                                if s == "amax" else v for s, v in e.items()}
                            for t, e in ts.items()} for g, ts in gs.items()}
                    for m, gs in stats.items()}
    _write_run(tmp_path, (0, 10), broken)
    assert mismatches(tmp_path, (0, 10))


def test_jax_scalars_and_a_single_nan_entry(tmp_path):
    stats = {"Dense_0": {"dot_general_0": {"activation": {
        "amax": jnp.float32(1.5), "mean": jnp.float32(jnp.nan), "min": np.float32(-0.5)}}}}
    with StatsLogger(tmp_path, tensorboard=False) as log:
        assert log.write(jnp.int32(7), stats) == 2
    assert not list(tmp_path.glob("events.out.tfevents*"))
    assert read_jsonl(tmp_path / "stats.jsonl") == [{"step": 7, "stats": {
        "Dense_0/dot_general_0/activation/amax": 1.5,
        "Dense_0/dot_general_0/activation/min": -0.5}}]


def test_only_process_zero_writes(tmp_path, monkeypatch):
    with StatsLogger(tmp_path / "p1", process_index=1) as log:
        assert log.write(0, synthetic(1)) == 0
        log.log_decision(0, "Dense_0", "dot_general_0", "compute_dtype", "sqnr_db", 3.0)
    assert not (tmp_path / "p1").exists()
    # The default asks jax.process_index().
    monkeypatch.setattr(jax, "process_index", lambda *a, **k: 1)
    with StatsLogger(tmp_path / "p1b") as log:
        assert log.write(0, synthetic(1)) == 0
    assert not (tmp_path / "p1b").exists()
    monkeypatch.setattr(jax, "process_index", lambda *a, **k: 0)
    with StatsLogger(tmp_path / "p0") as log:
        assert log.write(0, synthetic(1)) > 0
    assert (tmp_path / "p0" / "stats.jsonl").exists()
    assert list((tmp_path / "p0").glob("events.out.tfevents*"))


def test_decisions_jsonl(tmp_path):
    with StatsLogger(tmp_path, tensorboard=False) as log:
        log.log_decision(40, "Block_0/Dense_1", "dot_general_1", "compute_dtype",
                         "output_grad/underflow_share", jnp.float32(0.25))
        log.log_decision(90, "", "dot_general_0", "per_tensor_current", "activation/sqnr_db",
                         12.5)
    assert read_jsonl(tmp_path / "decisions.jsonl") == [
        {"step": 40, "module": "Block_0/Dense_1", "gemm": "dot_general_1",
         "setting": "compute_dtype", "stat": "output_grad/underflow_share", "value": 0.25},
        {"step": 90, "module": "", "gemm": "dot_general_0", "setting": "per_tensor_current",
         "stat": "activation/sqnr_db", "value": 12.5}]


def test_each_write_is_on_disk_before_close(tmp_path):
    log = StatsLogger(tmp_path)
    log.write(0, synthetic(0))
    log.write(10, synthetic(10))
    assert mismatches(tmp_path, (0, 10)) == []
    log.close()


def test_appends_to_an_existing_log(tmp_path):
    """A resumed run (a second logger, here within the same second) keeps both parts."""
    with StatsLogger(tmp_path) as log:
        log.write(0, synthetic(0))
    with StatsLogger(tmp_path) as log:
        log.write(10, synthetic(10))
    assert len(list(tmp_path.glob("events.out.tfevents.*"))) == 2
    assert mismatches(tmp_path, (0, 10)) == []


@pytest.mark.parametrize("tag,parts", [
    ("a/b/c/dot_general_0/weight/amax", ("a/b/c", "dot_general_0", "weight", "amax")),
    ("Dense_0/dot_general_0/weight/amax", ("Dense_0", "dot_general_0", "weight", "amax")),
    ("dot_general_0/dgrad/std", ("", "dot_general_0", "dgrad", "std")),
    ("/dot_general_0/dgrad/std", ("", "dot_general_0", "dgrad", "std")),
])
def test_split_tag(tag, parts):
    assert split_tag(tag) == parts


def test_split_tag_rejects_short_tags():
    with pytest.raises(ValueError, match="tag="):
        split_tag("weight/amax")


def test_bad_input(tmp_path):
    with pytest.raises(TypeError, match="stats"):
        flatten_stats({"Dense_0": {"dot_general_0": {"amax": 1.0}}})
    with pytest.raises(TypeError, match="stats"):
        flatten_stats([1.0])
    with pytest.raises(ValueError, match="gemm_name"):
        flatten_stats({"Dense_0": {"a/b": {"weight": {"amax": 1.0}}}})
    with pytest.raises(ValueError, match="stat="):
        flatten_stats({"Dense_0": {"g": {"weight": {"my_stat": [1.0, 2.0]}}}})
    with pytest.raises(ValueError, match="tensorboard=True or jsonl=True"):
        StatsLogger(tmp_path, tensorboard=False, jsonl=False)
    log = StatsLogger(tmp_path, tensorboard=False)
    with pytest.raises(TypeError, match="step"):
        log.write(1.5, synthetic(1))
    log.close()
    with pytest.raises(RuntimeError, match="closed"):
        log.write(1, synthetic(1))


# ---- reductions of per-shard statistics -------------------------------------------------


def _np_stats(x: np.ndarray) -> dict[str, float]:
    """The debug statistics of one tensor in float64 NumPy (the quantization ones with a
    stand-in quantizer: rounding to multiples of 0.25 clipped at 1.5)."""
    a = np.abs(x)
    nz = a[a != 0]
    q = np.clip(np.round(x * 4) / 4, -1.5, 1.5)
    return {
        "min": x.min(), "max": x.max(), "amax": a.max(), "mean": x.mean(), "std": x.std(),
        "l1_norm": a.sum(), "l2_norm": np.sqrt((x * x).sum()),
        "dynamic_range": np.log2(a.max() / nz.min()) if nz.size else 0.0,
        "max_blockwise_dynamic_range": np.log2(a.max() / nz.min()),
        "nonfinite_count": float((~np.isfinite(x)).sum()),
        "underflow_share": ((x != 0) & (q == 0)).sum() / (x != 0).sum(),
        "saturation_share": (a > 1.625).mean(),
        "mse": ((x - q) ** 2).mean(),
        "sqnr_db": 10 * np.log10((x * x).sum() / ((x - q) ** 2).sum()),
        "scale_min": a.min(), "scale_max": a.max(),
    }


EXACT = {"min", "max", "amax", "mean", "std", "l1_norm", "l2_norm", "nonfinite_count",
         "saturation_share", "mse", "scale_min", "scale_max"}


def test_every_rule_is_documented_and_checked_here():
    assert set(REDUCTIONS) == set(_np_stats(np.linspace(-2.0, 1.9, 8)))


@pytest.mark.parametrize("stat", sorted(REDUCTIONS))
def test_reduction_of_equal_shards_against_the_whole_tensor(stat):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((4, 64)) * rng.choice([1e-2, 1.0, 3.0], (4, 1))
    x[1, :5] = 0.0
    whole = float(_np_stats(x.reshape(-1))[stat])
    shards = [_np_stats(row) for row in x]
    per = np.asarray([s[stat] for s in shards])
    means = np.asarray([s["mean"] for s in shards]) if stat == "std" else None
    got = reduce_stat(stat, per, means=means)
    if stat in EXACT:
        np.testing.assert_allclose(got, whole, rtol=1e-12, atol=0)
    elif stat in ("dynamic_range", "max_blockwise_dynamic_range"):
        assert got == per.max() <= whole + 1e-12  # a lower bound of the whole tensor's range
    elif stat == "sqnr_db":
        assert got == per.min() <= whole  # the worst shard: conservative
    else:  # underflow_share: the mean of the shares
        assert got == pytest.approx(per.mean(), rel=1e-15)


@pytest.mark.parametrize("stat,values,want", [
    ("amax", [1.0, 4.0, 2.0], 4.0), ("max", [-3.0, -1.0], -1.0), ("min", [-3.0, -1.0], -3.0),
    ("scale_min", [0.5, 0.25], 0.25), ("scale_max", [0.5, 0.25], 0.5),
    ("dynamic_range", [3.0, 7.0], 7.0), ("max_blockwise_dynamic_range", [9.0, 2.0], 9.0),
    ("nonfinite_count", [1.0, 0.0, 2.0, 4.0], 7.0), ("l1_norm", [1.5, 2.5], 4.0),
    ("l2_norm", [3.0, 4.0], 5.0), ("mean", [1.0, 2.0, 6.0], 3.0),
    ("underflow_share", [0.0, 0.5], 0.25), ("saturation_share", [0.25, 0.75], 0.5),
    ("mse", [1.0, 3.0], 2.0), ("sqnr_db", [20.0, 14.0, INF], 14.0),
    ("std", [3.0, 4.0], math.sqrt(12.5)),  # no means: root mean square
])
def test_reduction_rules_by_hand(stat, values, want):
    assert reduce_stat(stat, values) == want
    assert reduce_stat(stat, np.asarray(values, np.float32)) == pytest.approx(want, rel=1e-7)
    assert reduce_stat(stat, jnp.asarray(values, jnp.float32)) == pytest.approx(want,
                                                                               rel=1e-7)


def test_scalar_passes_through_and_nan_shard_propagates():
    assert reduce_stat("anything", 2.5) == 2.5
    assert reduce_stat("amax", np.float32(2.5)) == 2.5
    assert math.isnan(reduce_stat("amax", [1.0, NAN]))


def test_flatten_reduces_a_leading_device_axis_and_pools_std():
    # Shards {-2, 0} and {0, 2}: each std 1, means -1 and 1; the whole tensor's std is sqrt(2).
    stats = {"D": {"dot_general_0": {"dgrad": {
        "mean": np.asarray([-1.0, 1.0]), "std": np.asarray([1.0, 1.0]),
        "amax": [np.float32(2.0), np.float32(2.0)], "nonfinite_count": jnp.asarray([1., 2.])}}}}
    assert flatten_stats(stats) == {
        "D/dot_general_0/dgrad/mean": 0.0, "D/dot_general_0/dgrad/std": math.sqrt(2.0),
        "D/dot_general_0/dgrad/amax": 2.0, "D/dot_general_0/dgrad/nonfinite_count": 3.0}


_DEVICES = r'''
import json, sys
import jax, jax.numpy as jnp, numpy as np
from fmtkit.debug.log import StatsLogger

assert jax.device_count() == 4, jax.devices()
x = np.random.default_rng(0).standard_normal((4, 32)).astype(np.float32)
x[2, 3] = np.inf
def shard_stats(v):
    a = jnp.abs(v)
    return {"amax": jnp.max(jnp.where(jnp.isfinite(a), a, 0)), "min": jnp.min(v),
            "nonfinite_count": jnp.sum(~jnp.isfinite(v)).astype(jnp.float32),
            "mean": jnp.mean(jnp.where(jnp.isfinite(v), v, 0))}
per_device = jax.pmap(shard_stats)(x)   # each leaf f32[4], one value per device
assert len(per_device["amax"].sharding.device_set) == 4
with StatsLogger(sys.argv[1], tensorboard=False) as log:
    log.write(3, {"Block_0/Dense_0": {"dot_general_0": {"activation": per_device}}})
print(json.dumps(x.astype(np.float64).tolist()))
'''


def test_per_device_statistics_on_four_simulated_devices(tmp_path):
    """Statistics computed per device by pmap on four simulated CPU devices (a subprocess:
    the suite runs on one device) are written once, reduced by their rules."""
    root = Path(__file__).resolve().parents[2]
    env = child_env("--xla_force_host_platform_device_count=4",
                    "--xla_allow_excess_precision=false", pythonpath=(root,))
    out = subprocess.run([sys.executable, "-c", _DEVICES, str(tmp_path)], capture_output=True,
                         text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    x = np.asarray(json.loads(out.stdout.strip().splitlines()[-1]))
    finite = np.where(np.isfinite(x), x, 0.0)
    [rec] = read_jsonl(tmp_path / "stats.jsonl")
    p = "Block_0/Dense_0/dot_general_0/activation/"
    assert rec["step"] == 3
    assert rec["stats"][p + "amax"] == np.abs(finite).max()
    assert rec["stats"][p + "min"] == x.min()
    assert rec["stats"][p + "nonfinite_count"] == 1.0
    # The mean of the four f32 shard means, against the float64 mean of the whole.
    np.testing.assert_allclose(rec["stats"][p + "mean"], finite.mean(), rtol=1e-6)


def test_no_file_is_opened_before_writing_on_other_processes(tmp_path):
    log = StatsLogger(tmp_path / "x", process_index=3)
    assert not log.writes and log.write(1, synthetic(1)) == 0
    log.close()
    assert dlog.JSONL_NAME == "stats.jsonl" and not (tmp_path / "x").exists()


def test_the_former_module_path_warns_and_re_exports(monkeypatch):
    import importlib
    import sys

    from fmtkit.debug import log

    monkeypatch.delitem(sys.modules, "fmtkit.debuglog", raising=False)
    with pytest.warns(DeprecationWarning, match="fmtkit.debuglog is deprecated: use "
                                                "fmtkit.debug.log"):
        old = importlib.import_module("fmtkit.debuglog")
    assert old.__all__ == log.__all__
    assert all(getattr(old, n) is getattr(log, n) for n in log.__all__)
