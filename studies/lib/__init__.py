"""What the studies build on: ``models`` (the reference transformer), ``corpus`` (the
byte-level training text), ``regimes`` (training regimes: outliers, tiny models),
``stats`` (paired statistics over seeds) and ``common`` (the study protocol, plots, tables,
the results writer). Never imports the application (``studies.app``)."""
