"""Repository tools: programs run from a checkout, not part of the installed ``fmtkit`` wheel.

* ``gpu_check``: the one prepared GPU check (``python3 -m tools.gpu_check OUTDIR``,
  ``make gpu-check``).

Tools sit on top of everything: they import ``fmtkit`` and ``pallas_kernels`` and run the
``fmtkit`` command line (``python -m studies.app.cli``) as a command; nothing imports them
(``tests/test_layering.py``).
"""
