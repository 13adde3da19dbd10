"""The numerics studies: each measures formats, casts, scaling or optimizer arithmetic
directly, without training a model (``fmtkit study NAME``)."""
