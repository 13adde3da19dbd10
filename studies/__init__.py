"""Studies, benchmarks and the application around them (``fmtkit`` never imports this package).

* ``app/``: the application: ``cli`` (the ``fmtkit`` command), ``runner`` (runs a study and
  writes its results), ``registry`` (finds the studies and benchmarks by the ``NAME``,
  ``SUMMARY`` and ``ORDER`` their modules declare), ``launch`` (several processes on one
  machine), ``debug_report`` (``fmtkit debug``).
* ``lib/``: what the studies build on: ``models``, ``corpus``, ``regimes``, ``stats``,
  ``common`` (the environment capture and the results writer), ``timing`` (the interleaved
  timing loop, which the GPU check uses too). Never imports ``app/``.
* ``numerics/``: the studies that measure without training, one module each (``fmtkit study
  NAME``): ``format_ranges`` (study ``formats``), ``underflow``, ``master_weights``,
  ``loss_scale``, ``rounding``, ``fp8_outliers``, ``accumulation``, ``allreduce``,
  ``memory_footprint`` (study ``memory``).
* ``lm/``: the studies that train the small language model, one module each: ``ablate`` (the
  main job), ``sensitivity``, ``router_precision``, ``fp8_recipes``, ``outlier_dose``,
  ``autopilot``, ``delayed_lag``, ``grad_blocks``, ``fp8_long``.
* ``bench/``: the side-by-side benchmarks, one module each (``fmtkit bench NAME``), listed
  with their summaries by ``fmtkit bench list``.
* ``training/``: the training engine the language-model studies share (config, setups, data,
  optimizer, mesh, metrics, step, the loop of one seed, several seeds in one vmapped step,
  checkpoint, distributed, the FP8 dose-response runs, the FP4 regime's telemetry).

A test (``tests/studies/test_registry.py``) holds the lists above to the folders' modules.
"""
