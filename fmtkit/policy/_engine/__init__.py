"""The policy engine: a traced model re-interpreted under a resolved plan.

``trace`` traces a model and ``runner`` runs the trace under the plan a frontend hands it
(the entry points the frontends call); ``scopes`` names the modules that wrote each
equation; ``analysis`` finds projections, the output head and delayed-FP8 slots;
``interpreter`` walks the trace, binding every equation again under the plan, and ``matmul``
computes each matmul it meets (compute dtype, FP8/FP4 recipe, the GEMM hook); ``handlers``
holds one ``walkers.Handler`` per primitive with a body (its facts and its interpretation),
looked up by both; ``binding`` and ``cotangent`` rebuild equations and round cotangents;
``jaxprs`` holds the jaxpr helpers (a leaf) and ``caches`` every cache. The engine never
imports a frontend (``fmtkit.policy._frontends``).
"""
