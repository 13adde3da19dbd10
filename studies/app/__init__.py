"""The application: ``cli`` (the ``fmtkit`` command), ``runner`` (runs a study and writes its
results), ``launch`` (several processes on one machine) and ``debug_report`` (``fmtkit
debug``). The studies' libraries never import it."""
