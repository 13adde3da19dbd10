"""The GPU check's ``profile`` phase on CPU: the trace reduction against hand-computed
durations, the installed profiler's trace format, the profiler's shared memory against
Mosaic GPU's own count (cross-lowering for the H200), and the phase in the check."""

import json

import jax
import jax.numpy as jnp
import pytest

from tools.gpu_check import profile, report, watcher, worker
from tools.gpu_check.cli import main


def _ev(name, ph, ts, tid):
    # One event as ProfilerSpec.dump writes it: ts in units of 1000 SM cycles within a trace.
    return {"name": name, "ph": ph, "ts": ts, "pid": 1, "tid": tid}


def _hand_trace():
    """Two CTAs' warpgroups (tid 1-3: CTA 0's consumer0, consumer1, producer; tid 4: CTA
    1's consumer0), durations in cycles in the comments."""
    return {"displayTimeUnit": "ns", "traceEvents": [
        _ev("Init", "B", 1000.0, 1), _ev("Init", "E", 1000.1, 1),          # 100
        _ev("tile", "B", 1000.2, 1),                                       # tile: 2000
        _ev("k_step", "B", 1000.3, 1), _ev("k_step", "E", 1001.3, 1),      # 1000
        _ev("k_step", "B", 1001.5, 1), _ev("k_step", "E", 1002.0, 1),      # 500
        _ev("tile", "E", 1002.2, 1),                                       # span 2200
        _ev("Init", "B", 2000.0, 2), _ev("Init", "E", 2000.05, 2),         # 50
        _ev("tile", "B", 2000.05, 2),                                      # tile: 1000
        _ev("k_step", "B", 2000.1, 2), _ev("k_step", "E", 2000.9, 2),      # 800
        _ev("tile", "E", 2001.05, 2),                                      # span 1050
        _ev("Init", "B", 3000.0, 3), _ev("Init", "E", 3000.1, 3),          # 100
        _ev("tile", "B", 3000.1, 3), _ev("tile", "E", 3002.1, 3),          # 2000, span 2100
        _ev("Init", "B", 500.0, 4), _ev("Init", "E", 500.1, 4),            # 100
        _ev("tile", "B", 500.1, 4),                                        # tile: 1000
        _ev("k_step", "B", 500.2, 4), _ev("k_step", "E", 500.9, 4),        # 700
        _ev("tile", "E", 501.1, 4),                                        # span 1100
    ]}


def test_reduce_trace_against_hand_computed_durations():
    got = profile.reduce_trace(_hand_trace())
    assert got["unit"] == "SM clock cycles"
    c0, c1, p = (got["roles"][r] for r in ("consumer0", "consumer1", "producer"))
    # consumer0: tids 1 and 4, spans 2200 + 1100 = 3300
    assert (c0["traces"], c0["span_cycles_total"], c0["span_cycles_median"]) == (2, 3300, 1650)
    assert c0["events_per_trace_max"] == 8  # tid 1: Init, tile, two k_steps
    assert c0["regions"]["k_step"] == {"count": 3, "total_cycles": 2200, "median_cycles": 700,
                                       "share": pytest.approx(2200 / 3300, abs=1e-6)}
    assert c0["regions"]["tile"] == {"count": 2, "total_cycles": 3000, "median_cycles": 1500,
                                     "share": pytest.approx(3000 / 3300, abs=1e-6)}
    assert c0["regions"]["Init"]["total_cycles"] == 200
    assert c1["span_cycles_total"] == 1050
    assert c1["regions"]["k_step"]["total_cycles"] == 800
    assert c1["regions"]["k_step"]["share"] == pytest.approx(800 / 1050, abs=1e-6)
    assert p["span_cycles_total"] == 2100 and "k_step" not in p["regions"]
    assert p["regions"]["tile"]["share"] == pytest.approx(2000 / 2100, abs=1e-6)


def test_reduce_trace_roles_follow_the_warpgroup_index():
    """Negative control: the same trace with every tid one lower (as if the writer counted
    warpgroups from tid 0) moves the K steps onto other roles, and the summary shows it."""
    trace = _hand_trace()
    for ev in trace["traceEvents"]:
        ev["tid"] += 1
    got = profile.reduce_trace(trace)["roles"]
    assert "k_step" not in got["consumer0"]["regions"]
    assert got["producer"]["regions"]["k_step"]["count"] == 1  # consumer1's step, moved


@pytest.mark.parametrize("events, match", [
    ([_ev("k_step", "E", 1.0, 1)], "without its begin"),
    ([_ev("tile", "B", 1.0, 1), _ev("k_step", "E", 1.5, 1)], "without its begin"),
    ([_ev("tile", "B", 1.0, 1)], "left open"),
    ([{**_ev("tile", "B", 1.0, 1), "ph": "X"}], "ph must be"),
])
def test_reduce_trace_rejects_unbalanced_traces(events, match):
    with pytest.raises(ValueError, match=match):
        profile.reduce_trace({"traceEvents": events})
    with pytest.raises(ValueError, match="traceEvents"):
        profile.reduce_trace({"events": events})


def test_installed_writer_trace_reduces_to_the_buffer_it_was_given(tmp_path):
    """``synthetic_trace`` hands the installed writer (``ProfilerSpec.dump``) a buffer with
    known clocks: per compute warpgroup Init 100 cycles, a tile 101..5001 holding four
    k_steps of 1000; the producer Init 100 and the tile; every trace spans 0..5001."""
    trace = profile.synthetic_trace(tmp_path / "t.json")
    assert trace["displayTimeUnit"] == "ns"
    assert {ev["tid"] for ev in trace["traceEvents"]} == set(range(1, 7))  # 2 CTAs x 3
    assert {ev["pid"] for ev in trace["traceEvents"]} == {8, 9}  # 1 + the SM ids 7 and 8
    roles = profile.reduce_trace(trace)["roles"]
    for role in ("consumer0", "consumer1"):
        r = roles[role]
        assert (r["traces"], r["span_cycles_total"]) == (2, 2 * 5001)
        assert r["regions"]["k_step"]["count"] == 8
        assert r["regions"]["k_step"]["total_cycles"] == 8000
        assert r["regions"]["k_step"]["median_cycles"] == 1000
        assert r["regions"]["tile"]["total_cycles"] == 2 * 4900
        assert r["regions"]["Init"]["total_cycles"] == 200
    assert roles["producer"]["regions"].keys() == {"Init", "tile"}
    assert roles["producer"]["regions"]["tile"]["share"] == pytest.approx(4900 / 5001,
                                                                          abs=1e-6)


def test_profile_phase_is_registered():
    assert worker.PHASES.index("profile") == worker.PHASES.index("pytest") - 1
    items = worker.phase_items("profile", rehearsal=True, work=None, excluded=set())
    assert [name for name, _ in items] == [s[0] for s in profile.PROFILE_SHAPES]
    assert watcher.PHASE_CAP_S["profile"] <= 30 and "profile" in watcher.PHASE_SHARE
    empty = report.empty_report("x", True, 1.0)
    assert empty["profile"] == {} and empty["profile_traces"] == []
    filled = dict(empty)
    report.fill(filled, "profile", {"a": {"ok": True}}, None)
    assert filled["profile"] == {"a": {"ok": True}}


_H200 = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", platform="gpu", num_cores=132)


def _lower_profiled(name, m, n, k, out_dtype, b_rows, space, tmp_path):
    from pallas_kernels import blockwise_fp8_matmul

    cfg, _ = profile.fit_profile(m, n, k, out_dtype, b_rows)
    args = (jax.ShapeDtypeStruct((m, k), jnp.float8_e4m3fn),
            jax.ShapeDtypeStruct((m, k // 128), jnp.float32),
            jax.ShapeDtypeStruct((n, k), jnp.float8_e4m3fn),
            jax.ShapeDtypeStruct((n if b_rows else -(-n // 128), k // 128), jnp.float32))
    mesh = jax.sharding.AbstractMesh((), (), abstract_device=_H200)
    with jax.sharding.use_abstract_mesh(mesh), profile.profiled(tmp_path, space) as calls:
        with pytest.raises(ValueError) as e:
            jax.jit(lambda *a: blockwise_fp8_matmul(
                *a, out_dtype=out_dtype, impl="kernel", config=cfg)).trace(*args).lower(
                    lowering_platforms=("cuda",))
    return str(e.value), calls


@pytest.mark.slow
@pytest.mark.parametrize("shape", profile.PROFILE_SHAPES, ids=lambda s: s[0])
def test_profiler_buffer_fits_beside_the_kernel_as_mosaic_counts(shape, tmp_path):
    """The kernel with the profiler on lowers for the H200 with ``fit_profile``'s regions
    (Mosaic GPU's shared-memory check passes; lowering then stops at the profiler's dump
    callback, which XLA:CPU cannot emit for a CUDA module), and one region more per
    warpgroup overflows where the shared memory bounds it: the fit is exact. About 4 s a
    shape."""
    from pallas_kernels.config import choose_config

    cfg, space = profile.fit_profile(*shape[1:])
    _, m, n, k, out_dtype, b_rows = shape
    assert cfg == choose_config(m, n, k, out_dtype, 132, b_rows=b_rows)  # no stage cut
    assert space >= profile.MIN_PROFILE_SPACE
    ok, calls = _lower_profiled(*shape, space, tmp_path)
    assert "different from the lowering platform cuda" in ok, ok
    assert calls["kernels"] == 1 and calls["pipelines"] > 0 and calls["k_steps"] > 0
    over, _ = _lower_profiled(*shape, space + 1, tmp_path)
    if space < profile.PROFILE_SPACE:  # bounded by the shared memory: one more overflows
        assert "exceeds available shared memory" in over, over
    else:  # bounded by the cap (a tile with room to spare): one more still fits
        assert "different from the lowering platform cuda" in over, over


@pytest.mark.slow
def test_profiled_hooks_are_reached_only_by_the_kernel(tmp_path):
    """The interpret-mode kernel reaches both hooks; the reference path (negative control)
    reaches none, which the phase reports as a failure."""
    from pallas_kernels import blockwise_fp8_matmul
    from pallas_kernels.bench import make_operands

    ops = make_operands(128, 128, 256)
    args = (ops["xq"], ops["xs"], ops["wq"], ops["ws"])
    for impl, reached in (("interpret", True), ("reference", False)):
        with profile.profiled(tmp_path) as calls:
            jax.block_until_ready(blockwise_fp8_matmul(*args, impl=impl))
        assert all(calls.values()) is reached, (impl, calls)


@pytest.mark.slow
def test_profile_phase_rehearsal_on_cpu(tmp_path):
    """The phase through the watcher and a worker on CPU: the summary in the report, the
    raw traces beside it and not in the log tarball. About 20 s."""
    assert main(["--cpu-rehearsal", "--phases", "profile", str(tmp_path)]) == 0
    rep = json.loads((tmp_path / "gpu_check.json").read_text())
    names = [s[0] for s in profile.PROFILE_SHAPES]
    assert sorted(rep["profile"]) == sorted(names)
    assert rep["profile_traces"] == [f"gpu_check_profile_{n}.json" for n in sorted(names)]
    for name, r in rep["profile"].items():
        assert r["ok"] and r["synthetic_trace"] and not r["truncated"]
        assert set(r["roles"]) == set(profile.ROLES)
        assert r["roles"]["consumer0"]["regions"]["k_step"]["count"] == 8
        trace = json.loads((tmp_path / f"gpu_check_profile_{name}.json").read_text())
        assert profile.reduce_trace(trace)["roles"] == r["roles"]
    lines = [ln for ln in report.summary_lines(rep) if ln.startswith("profile ")]
    assert len(lines) == 2 and all("k_step median 1000 cycles" in ln for ln in lines)


def test_a_trace_cut_by_the_full_buffer_is_flagged(tmp_path):
    """The installed writer on a buffer of 4 regions per warpgroup that the bounds check
    filled (6 events: Init, tile begin, one k_step, the next k_step's begin): it closes the
    open regions at the last event and ``was_cut`` says so; a whole trace of two regions
    (negative control) is not flagged."""
    import numpy as np
    from jax.experimental.mosaic.gpu import profiler

    def write(events):
        spec = profiler.ProfilerSpec(4 * 4)  # as Mosaic builds it: profile_space * 2 * 2
        ids = {n: spec.intern_name(n) for n in ("Init", "tile", "k_step")}
        buf = np.zeros((1, 3, 16), np.uint32)
        for wg in range(3):
            tags = [ids[n] | (0 if ph == "B" else profiler.ProfilerSpec.EXIT)
                    for n, ph, _ in events]
            buf[0, wg, :3] = (1000, 0, 2 * len(events))
            buf[0, wg, 3:3 + 2 * len(events)] = np.array(
                [(tag, t) for tag, (_, _, t) in zip(tags, events)], np.uint32).ravel()
        with open(tmp_path / "t.json", "w") as f:
            spec.dump(buf.ravel(), f, grid=(1,), block=(384,))
        return profile.reduce_trace(json.loads((tmp_path / "t.json").read_text()))

    cut = write([("Init", "B", 0), ("Init", "E", 100), ("tile", "B", 101),
                 ("k_step", "B", 201), ("k_step", "E", 1201), ("k_step", "B", 1401)])
    r = cut["roles"]["consumer0"]
    assert r["events_per_trace_max"] == 8  # 6 recorded + the writer's 2 ends
    assert r["regions"]["k_step"]["count"] == 2  # the cut one ends where it was cut: 0 long
    assert r["regions"]["tile"]["total_cycles"] == 1300  # 101 .. 1401
    assert profile.was_cut(cut, 4)
    whole = write([("Init", "B", 0), ("Init", "E", 100), ("tile", "B", 101),
                   ("tile", "E", 1101)])
    assert not profile.was_cut(whole, 4)
