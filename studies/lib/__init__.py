"""What the studies build on: ``models`` (the reference transformer), ``corpus`` (the
byte-level training text), ``regimes`` (training regimes: outliers, tiny models),
``stats`` (paired statistics over seeds), ``common`` (the study protocol, plots, tables,
the environment capture and the results writer) and ``timing`` (the interleaved timing loop
of the benchmarks and the GPU check). Never imports the application (``studies.app``)."""
