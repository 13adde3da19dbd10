"""Side-by-side benchmarks, one module per ``fmtkit bench NAME``: each times fmtkit and its
baseline in one process and prints the ratio last. A module declares ``NAME`` (its
command-line id), ``SUMMARY`` (one line for ``fmtkit bench list``) and ``main(argv) -> int``
(``studies.app.registry`` finds it). They time with ``studies.lib.timing`` and write
``runs/bench-NAME/results.json`` with ``studies.lib.common.write_bench_results``."""
