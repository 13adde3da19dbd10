"""The launcher (``studies.app.launch``) and the environment it hands to each process (no JAX
runtime started here: plain Python children)."""

from __future__ import annotations

import sys
import time

import pytest

from studies.app import launch
from studies.training import distributed

PY = sys.executable


def test_each_process_gets_its_id_the_count_and_the_coordinator(tmp_path):
    code = (f"import os, pathlib; e = os.environ; "
            f"pathlib.Path(r'{tmp_path}', e['FMTKIT_PROCESS_ID'])"
            ".write_text(' '.join([e['FMTKIT_NUM_PROCESSES'], e['JAX_COORDINATOR_ADDRESS'], "
            "e['XLA_FLAGS']]))")
    assert launch.launch([PY, "-c", code], 3, devices_per_process=2, port=23456,
                         timeout=60) == 0
    for i in range(3):
        n, addr, flags = (tmp_path / str(i)).read_text().split(" ", 2)
        assert (n, addr) == ("3", "127.0.0.1:23456")
        assert flags.split().count("--xla_force_host_platform_device_count=2") == 1


def test_one_failure_stops_the_others_with_its_status():
    # Process 1 fails at once; process 0 would sleep for 60 s (a peer waiting forever on a
    # collective): the launcher must end it and report process 1's status.
    code = ("import os, sys, time; i = int(os.environ['FMTKIT_PROCESS_ID']); "
            "sys.exit(3) if i == 1 else time.sleep(60)")
    t0 = time.monotonic()
    assert launch.launch([PY, "-c", code], 2, timeout=120, grace=1.0) == 3
    assert time.monotonic() - t0 < 30


def test_timeout_kills_every_process():
    t0 = time.monotonic()
    assert launch.launch([PY, "-c", "import time; time.sleep(60)"], 2, timeout=1.0,
                         grace=1.0) == 124
    assert time.monotonic() - t0 < 30


@pytest.mark.parametrize("argv, message", [
    (["--num-processes", "2"], "usage"),
    (["--num-processes", "0", "--", PY, "-c", "pass"], "num_processes must be an int >= 1"),
])
def test_bad_launcher_arguments_are_clear_errors(argv, message, capsys):
    assert launch.main(argv) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("env, message", [
    ({"FMTKIT_NUM_PROCESSES": "two", "FMTKIT_PROCESS_ID": "0"}, "must be integers"),
    ({"FMTKIT_NUM_PROCESSES": "2", "FMTKIT_PROCESS_ID": "2",
      "JAX_COORDINATOR_ADDRESS": "127.0.0.1:1"}, "in 0..1"),
    ({"FMTKIT_NUM_PROCESSES": "2", "FMTKIT_PROCESS_ID": "1"}, "JAX_COORDINATOR_ADDRESS"),
])
def test_bad_environment_is_a_clear_error(env, message):
    with pytest.raises(ValueError, match=message):
        distributed.initialize_from_env(env)


def test_no_environment_means_a_single_process():
    assert distributed.initialize_from_env({}) is False


def test_bench_counts_all_reduces_and_their_bytes():
    """``fmtkit bench multiprocess`` reads what a step communicates from its HLO: a combined
    all-reduce counts once with all its operands; other instructions, and all-reduces inside
    a conditional's branches (run only when taken), are not counted."""
    from studies.bench.multiprocess import all_reduces

    hlo = """
%boot_spmd (p: (f32[])) -> (f32[]) {
  %all-reduce.7 = f32[] all-reduce(%m), channel_id=9, to_apply=%r
}

%other_spmd (p: (f32[])) -> (f32[]) {
  %all-reduce.8 = f32[] all-reduce(%m), channel_id=10, to_apply=%r
}

ENTRY %main.1 (p0: f32[8]) -> f32[] {
  %all-reduce.41 = (f32[], f32[], f32[]) all-reduce(%a, %b, %c), channel_id=2, to_apply=%r
  %all-reduce.35 = (f32[64,128]{1,0}, bf16[128]{0}) all-reduce(%x, %y), channel_id=1
  %ars = f32[8]{0} all-reduce-start(%z), channel_id=3
  %add.1 = f32[2]{0} add(%a, %b)
  %c.1 = (f32[]) conditional(%p, %t, %t), branch_computations={%boot_spmd, %other_spmd}
}
"""
    assert all_reduces(hlo) == (3, 3 * 4 + 64 * 128 * 4 + 128 * 2 + 8 * 4)
