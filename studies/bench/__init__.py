"""Side-by-side benchmarks, one module per ``fmtkit bench NAME`` (``NAME`` is the module name
with ``-`` for ``_``): each times fmtkit and its baseline in one process and prints the ratio
last. ``_timing`` holds the shared timer and the results writer."""
