"""Start N local processes of one multi-process JAX run (``jax.distributed``), on one machine.

Usage::

    python -m studies.app.launch --num-processes 2 -- python -m studies.app.cli ablate --steps 20 \\
        --policies fp32 --data-parallel 2

Each process gets the environment ``studies.training.distributed.initialize_from_env`` reads
(``JAX_COORDINATOR_ADDRESS=127.0.0.1:PORT``, ``FMTKIT_NUM_PROCESSES``, ``FMTKIT_PROCESS_ID``)
and, on CPU, ``--devices-per-process`` simulated devices (``XLA_FLAGS``). ``--data-parallel``
of the run must be the global device count (processes x devices per process).

On several hosts, start one process per host yourself with the same three variables
(``JAX_COORDINATOR_ADDRESS`` = process 0's host name and a port open between the hosts,
``FMTKIT_PROCESS_ID`` = 0 on that host, 1.. on the others).

Failure handling: when any process exits with a non-zero status (or is killed), the launcher
kills the others (SIGTERM, then SIGKILL after ``--grace`` seconds) and exits with that status,
so that no process waits forever on a collective with a dead peer; the run can then be
restarted from its latest checkpoint (``--resume``). ``--timeout`` bounds the whole run.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time

__all__ = ["free_port", "launch", "main"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _kill_all(procs: list[subprocess.Popen], grace: float) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def launch(command: list[str], num_processes: int, *, devices_per_process: int = 1,
           port: int | None = None, timeout: float | None = None, grace: float = 5.0,
           env: dict[str, str] | None = None) -> int:
    """Runs ``command`` as ``num_processes`` processes of one ``jax.distributed`` run.

    Args:
      command: the program and its arguments (each process runs the same).
      num_processes: how many processes (>= 1).
      devices_per_process: simulated CPU devices per process (``XLA_FLAGS``).
      port: the coordinator's port on 127.0.0.1 (default: a free one).
      timeout: seconds before every process is killed (None: no limit).
      grace: seconds between SIGTERM and SIGKILL when stopping the processes.
      env: the base environment (default ``os.environ``).

    Returns:
      0 when all processes succeed; else the first failure's status (negative: the signal
      that killed it, as ``subprocess`` reports it; 124 on timeout).

    Raises:
      ValueError: ``num_processes`` or ``devices_per_process`` below 1, empty ``command``.
    """
    if not command:
        raise ValueError("command must name the program to run (after --).")
    for name, v in (("num_processes", num_processes),
                    ("devices_per_process", devices_per_process)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}.")
    port = free_port() if port is None else port
    base = dict(os.environ if env is None else env)
    flags = base.get("XLA_FLAGS", "")
    flags = " ".join(f for f in flags.split()
                     if not f.startswith("--xla_force_host_platform_device_count"))
    procs: list[subprocess.Popen] = []
    try:
        for i in range(num_processes):
            e = dict(base, JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
                     FMTKIT_NUM_PROCESSES=str(num_processes), FMTKIT_PROCESS_ID=str(i),
                     XLA_FLAGS=(flags + " --xla_force_host_platform_device_count="
                                f"{devices_per_process}").strip())
            procs.append(subprocess.Popen(command, env=e))
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            codes = [p.poll() for p in procs]
            bad = [c for c in codes if c not in (None, 0)]
            if bad:
                _kill_all(procs, grace)
                return bad[0]
            if all(c == 0 for c in codes):
                return 0
            if deadline is not None and time.monotonic() > deadline:
                _kill_all(procs, grace)
                return 124
            time.sleep(0.05)
    finally:
        _kill_all(procs, grace)


def main(argv: list[str] | None = None) -> int:
    """``python -m studies.app.launch --num-processes N [options] -- COMMAND ...``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        print("usage: python -m studies.app.launch --num-processes N [options] -- COMMAND ...",
              file=sys.stderr)
        return 2
    k = argv.index("--")
    parser = argparse.ArgumentParser(prog="python -m studies.app.launch",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--num-processes", type=int, required=True)
    parser.add_argument("--devices-per-process", type=int, default=1)
    parser.add_argument("--port", type=int, default=None, help="coordinator port (free one)")
    parser.add_argument("--timeout", type=float, default=None, help="seconds for the run")
    parser.add_argument("--grace", type=float, default=5.0)
    args = parser.parse_args(argv[:k])
    try:
        return launch(argv[k + 1:], args.num_processes,
                      devices_per_process=args.devices_per_process, port=args.port,
                      timeout=args.timeout, grace=args.grace)
    except ValueError as e:
        print(f"studies.app.launch: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
