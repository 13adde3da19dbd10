"""Studies, benchmarks and the application around them (``fmtkit`` never imports this package).

* The studies, one module each (``fmtkit study NAME``): ``format_ranges`` (study
  ``formats``), ``underflow``, ``master_weights``, ``loss_scale``, ``rounding``,
  ``fp8_outliers``, ``router_precision``, ``fp8_recipes``, ``accumulation``, ``allreduce``,
  ``memory_footprint`` (study ``memory``), ``sensitivity``, ``ablate`` (the main job).
* ``bench/``: the side-by-side benchmarks, one module each (``fmtkit bench NAME``).
* ``training/``: the LM-training library the training studies share (config, setups, data,
  optimizer, mesh, metrics, step, the loop of one seed, several seeds in one vmapped step,
  checkpoint, distributed).
* The application: ``cli`` (the ``fmtkit`` command), ``runner`` (runs a study and writes its
  results), ``launch`` (several processes on one machine), and what studies build on:
  ``models``, ``corpus``, ``regimes``, ``stats``, ``_common``.
"""
