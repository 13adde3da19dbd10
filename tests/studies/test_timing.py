"""The one interleaved timing loop of the benchmarks and the GPU check
(``studies.lib.timing``): who runs when, how many calls a sample holds, what is synced."""

from __future__ import annotations

import pytest

from studies.lib.timing import time_fn, time_interleaved, time_samples


def _recorder():
    log = []

    def fn(name):
        def call():
            log.append(name)
            return name
        return call
    return log, fn


def test_rounds_interleave_and_alternate():
    log, fn = _recorder()
    samples = time_samples({"a": fn("a"), "b": fn("b")}, 3)
    assert log == ["a", "b"] * 3
    assert {k: len(v) for k, v in samples.items()} == {"a": 3, "b": 3}
    assert all(t >= 0 for v in samples.values() for t in v)
    log.clear()
    time_samples({"a": fn("a"), "b": fn("b")}, 3, alternate=True)
    assert log == ["a", "b", "b", "a", "a", "b"]


def test_batches_and_syncs_per_implementation():
    log, fn = _recorder()
    synced = []
    samples = time_samples({"a": fn("a"), "b": fn("b")}, 2, calls={"a": 3},
                           syncs={"b": lambda outs: synced.append(list(outs))})
    assert log == ["a", "a", "a", "b"] * 2
    assert synced == [["b"], ["b"]]  # b's own sync gets its batch's outputs; a's is jax's
    assert [len(v) for v in samples.values()] == [2, 2]


def test_medians_after_warmup():
    log, fn = _recorder()
    times = time_interleaved({"a": fn("a")}, repeats=4, warmup=2)
    assert log == ["a"] * 6 and set(times) == {"a"} and times["a"] >= 0
    calls = []
    assert time_fn(lambda x: calls.append(x), 7, repeats=3, warmup=1) >= 0
    assert calls == [7] * 4


def test_a_sample_is_seconds_per_call(monkeypatch):
    # A clock that advances 1 s per reading: a batch of 4 calls read twice is 0.25 s a call.
    clock = iter(range(100))
    monkeypatch.setattr("studies.lib.timing.time.perf_counter", lambda: float(next(clock)))
    samples = time_samples({"a": lambda: 0}, 2, calls={"a": 4})
    assert samples == {"a": [pytest.approx(0.25), pytest.approx(0.25)]}
