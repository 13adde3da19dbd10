"""Deprecated: the log writer is ``fmtkit.debug.log``; this module re-exports its names and
warns once when imported."""

import warnings

from fmtkit.debug.log import (
    DECISIONS_NAME,
    JSONL_NAME,
    REDUCTIONS,
    StatsLogger,
    flatten_stats,
    reduce_stat,
    split_tag,
)

__all__ = ["DECISIONS_NAME", "JSONL_NAME", "REDUCTIONS", "StatsLogger", "flatten_stats",
           "reduce_stat", "split_tag"]

warnings.warn("fmtkit.debuglog is deprecated: use fmtkit.debug.log (the same names).",
              DeprecationWarning, stacklevel=2)
