"""Logs of per-GEMM statistics that people already read: TensorBoard event files and JSON lines.

The statistics of a debugged training step are a nested dict

    {module_path: {gemm_name: {tensor: {stat: scalar}}}}

(``module_path`` is the policy's module path and may contain ``"/"``, ``""`` for the root;
``gemm_name``, ``tensor`` and ``stat`` never do; a GEMM in a loop body has an array per
statistic, one value per iteration, see ``flatten_stats``). ``StatsLogger`` writes each
logged step as

* ``stats.jsonl``: one JSON object per logged step, ``{"step": 10, "stats": {tag: value}}``;
* TensorBoard event files (``events.out.tfevents.*``, written with tensorboardX, no
  TensorFlow): one scalar per tag at that step;
* ``decisions.jsonl``: one JSON object per precision decision (``log_decision``).

A tag is ``"module_path/gemm_name/tensor/stat"`` (``"gemm_name/tensor/stat"`` for the root
module, whose path is empty); ``split_tag`` takes it apart from the right. A GEMM in a loop
body (a scanned layer stack) logs one tag per iteration, its module path followed by
``"[i]"``, when the logger is given the statistics state (``layers``). Entries that are NaN
(steps that do not log hold NaN everywhere) are skipped, so a step without a logged
statistic writes nothing. JSON has no infinity: the file holds ``Infinity`` / ``-Infinity``
as Python's ``json`` writes and reads them (an exact quantization has ``sqnr_db = inf``).

Several devices or processes: only process 0 (``jax.process_index() == 0``) writes; the
others' loggers create no file. A statistic that arrives per device or shard (an array with
a leading axis, or a list of scalars) is reduced to one number by the rule of its name
(``REDUCTIONS``, see ``reduce_stat``).
"""

from __future__ import annotations

import itertools
import json
import math
import os
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np

__all__ = [
    "DECISIONS_NAME",
    "JSONL_NAME",
    "REDUCTIONS",
    "StatsLogger",
    "flatten_stats",
    "reduce_stat",
    "split_tag",
]

_EVENT_FILES = itertools.count()

JSONL_NAME = "stats.jsonl"
"""File name of the statistics log in a log directory: one JSON object per logged step."""

DECISIONS_NAME = "decisions.jsonl"
"""File name of the precision decisions in a log directory: one JSON object per decision."""

REDUCTIONS: dict[str, str] = {
    # The extremes of the whole tensor are the extremes over its shards (exact).
    "min": "min",
    "max": "max",
    "amax": "max",
    "scale_min": "min",
    "scale_max": "max",
    # The largest range over the shards: exact for the blockwise range when no tile straddles
    # two shards; for the whole tensor a lower bound (its smallest nonzero may sit in one shard
    # and its amax in another).
    "dynamic_range": "max",
    "max_blockwise_dynamic_range": "max",
    # Counts and sums add up (exact).
    "nonfinite_count": "sum",
    "l1_norm": "sum",
    # sqrt(sum x^2) over the tensor = sqrt of the sum of the shards' squares (exact).
    "l2_norm": "rss",
    # Means over the elements: the mean of the shards' means, exact for shards of one size
    # (what an even sharding gives); the shares are means over elements (saturation) or over
    # the nonzero elements (underflow: exact when the shards have as many nonzeros).
    "mean": "mean",
    "mse": "mean",
    "underflow_share": "mean",
    "saturation_share": "mean",
    # Population std of the whole tensor from equal-size shards: sqrt(mean(std_i^2 + mean_i^2)
    # - mean(mean_i)^2), exact when the tensor's "mean" is logged beside it; without it, the
    # root mean square of the shards' stds (the within-shard part, a lower bound).
    "std": "pooled_std",
    # The worst shard: a conservative figure (the whole tensor's SQNR is no lower).
    "sqnr_db": "min",
}
"""How a statistic that arrives per device or shard becomes one number, by statistic name.

``"max"``, ``"min"``, ``"sum"``, ``"mean"``; ``"rss"`` = sqrt(sum v_i^2);
``"pooled_std"`` = sqrt(mean(std_i^2 + mean_i^2) - mean(mean_i)^2) with the shards' means
(falls back to sqrt(mean(std_i^2)) when no mean is logged). The comments in the source say
which are exact for equal-size shards and which are bounds.
"""


def split_tag(tag: str) -> tuple[str, str, str, str]:
    """Splits a log tag into ``(module_path, gemm_name, tensor, stat)`` from the right.

    Args:
      tag: ``"module_path/gemm_name/tensor/stat"``; the root module's tags have no module path
        (``"dot_general_0/activation/amax"``), and a leading ``"/"`` is ignored.

    Returns:
      The four components; ``module_path`` is ``""`` for the root module.

    Raises:
      ValueError: if ``tag`` has fewer than three components or an empty one.

    Example:
      >>> split_tag("Block_0/MlpBlock_0/Dense_1/dot_general_0/weight/amax")
      ('Block_0/MlpBlock_0/Dense_1', 'dot_general_0', 'weight', 'amax')
      >>> split_tag("dot_general_0/dgrad/std")
      ('', 'dot_general_0', 'dgrad', 'std')
    """
    parts = tag.lstrip("/").rsplit("/", 3)
    if len(parts) == 3:
        parts = ["", *parts]
    if len(parts) != 4 or not all(parts[1:]):
        raise ValueError(f"tag={tag!r} is not 'module_path/gemm_name/tensor/stat'")
    module, gemm, tensor, stat = parts
    return module, gemm, tensor, stat


def _tag(module: str, gemm: str, tensor: str, stat: str) -> str:
    return "/".join(p for p in (module, gemm, tensor, stat) if p)


def _values(value: Any) -> np.ndarray:
    """The per-shard values of one statistic as float64 (a scalar gives one value)."""
    if isinstance(value, (list, tuple)):
        value = [np.asarray(v, dtype=np.float64).reshape(()) for v in value]
    arr = np.asarray(value, dtype=np.float64)
    return arr.reshape(-1)


def reduce_stat(stat: str, values: Any, *, means: Any = None) -> float:
    """Reduces one statistic given per device or shard to one number by ``REDUCTIONS[stat]``.

    Args:
      stat: the statistic's name (a key of ``REDUCTIONS``).
      values: a scalar (returned as it is), an array whose elements are the shards' values
        (a leading device axis), or a list of scalars.
      means: for ``stat="std"``: the shards' ``mean`` values in the same order (pooled
        std); ``None`` gives the root mean square of the stds.

    Returns:
      The reduced value as a Python float (NaN if any shard is NaN).

    Raises:
      ValueError: if several values arrive for a statistic with no rule in ``REDUCTIONS``,
        or ``means`` does not match ``values`` in length.

    Example:
      >>> reduce_stat("amax", [1.0, 3.0, 2.0])
      3.0
      >>> reduce_stat("nonfinite_count", [1.0, 0.0, 2.0])
      3.0
      >>> reduce_stat("l2_norm", [3.0, 4.0])
      5.0
      >>> reduce_stat("std", [1.0, 1.0], means=[-1.0, 1.0])  # {-2, 0} and {0, 2}
      1.4142135623730951
    """
    v = _values(values)
    if v.size == 1:
        return float(v[0])
    if v.size == 0:
        raise ValueError(f"values for stat={stat!r} is empty")
    rule = REDUCTIONS.get(stat)
    if rule is None:
        raise ValueError(f"stat={stat!r} arrives per shard but has no reduction rule; "
                         f"known: {', '.join(sorted(REDUCTIONS))}")
    if rule == "max":
        return float(np.max(v))
    if rule == "min":
        return float(np.min(v))
    if rule == "sum":
        return float(np.sum(v))
    if rule == "mean":
        return float(np.mean(v))
    if rule == "rss":
        return float(np.sqrt(np.sum(v * v)))
    # pooled_std
    if means is None:
        return float(np.sqrt(np.mean(v * v)))
    m = _values(means)
    if m.shape != v.shape:
        raise ValueError(f"means has {m.size} values but std has {v.size}")
    var = np.mean(v * v + m * m) - np.mean(m) ** 2
    return float(np.sqrt(max(var, 0.0)))


def flatten_stats(stats: Mapping[str, Any], *, layers: Mapping[str, Any] | None = None
                  ) -> dict[str, float]:
    """The statistics pytree as ``{tag: float}``, per-shard values reduced, NaN entries dropped.

    Args:
      stats: ``{module_path: {gemm_name: {tensor: {stat: value}}}}``; a value is a scalar
        (Python, NumPy or JAX) or per-shard values (an array with a leading device axis, a
        list), reduced by ``reduce_stat``.
      layers: for GEMMs in loop bodies (``nn.scan``, ``nnx.scan``, ``lax.scan`` layer
        stacks): the statistics state of ``fmtkit.debug.init`` (or any pytree keyed the same
        way), whose leaf shapes are the loops' trip counts (``()`` outside loops). A value
        whose entry there has shape ``(L,)`` holds one statistic per iteration in its last
        axis (after any shard axes), logged as one tag per iteration with the module path
        ``f"{module_path}[{i}]"`` (nested loops ``(L1, L2)``: ``"[i,j]"``). Without it
        every array axis counts as a shard axis.

    Returns:
      ``{"module_path/gemm_name/tensor/stat": value}`` in the pytree's order, without NaN.

    Raises:
      TypeError: if ``stats`` is not a dict nested four levels deep.
      ValueError: if a GEMM, tensor or statistic name is empty or contains ``"/"``, or a
        value does not end in the shape its entry in ``layers`` has.

    Example:
      >>> flatten_stats({"Dense_0": {"dot_general_0": {"weight": {"amax": 2.0,
      ...                                                          "min": float("nan")}}}})
      {'Dense_0/dot_general_0/weight/amax': 2.0}
      >>> import numpy as np
      >>> scanned = {"layers/Dense_0": {"dot_general_0": {"weight": {"amax":
      ...     np.array([1.0, 3.0])}}}}
      >>> flatten_stats(scanned, layers=scanned)
      {'layers/Dense_0[0]/dot_general_0/weight/amax': 1.0, \
'layers/Dense_0[1]/dot_general_0/weight/amax': 3.0}
    """
    stats = jax.device_get(stats)
    out: dict[str, float] = {}
    for module, gemms in _items(stats, "stats"):
        for gemm, tensors in _items(gemms, f"stats[{module!r}]"):
            _check_name(gemm, "gemm_name")
            for tensor, entries in _items(tensors, f"stats[{module!r}][{gemm!r}]"):
                _check_name(tensor, "tensor")
                where = f"stats[{module!r}][{gemm!r}][{tensor!r}]"
                for stat, value in _items(entries, where):
                    _check_name(stat, "stat")
                    if isinstance(value, Mapping):
                        raise TypeError(f"{where}[{stat!r}] is a dict; stats is nested "
                                        "{module_path: {gemm_name: {tensor: {stat: value}}}}")
                    means = entries.get("mean") if stat == "std" else None
                    loops = _loop_shape(layers, module, gemm, tensor, stat)
                    for suffix, v, m in _per_iteration(value, means, loops, f"{where}"
                                                       f"[{stat!r}]"):
                        if m is not None and _values(m).shape != _values(v).shape:
                            m = None  # not given per shard like the std: no pooling
                        x = reduce_stat(stat, v, means=m)
                        if not math.isnan(x):
                            out[_tag(module + suffix, gemm, tensor, stat)] = x
    return out


def _loop_shape(layers: Mapping[str, Any] | None, module: str, gemm: str, tensor: str,
                stat: str) -> tuple[int, ...]:
    """The trip counts of the loops around a statistic's GEMM, from ``layers``."""
    if layers is None:
        return ()
    leaf = layers.get(module, {}).get(gemm, {}).get(tensor, {}).get(stat)
    if leaf is None:
        return ()
    return tuple(leaf.shape) if hasattr(leaf, "shape") else tuple(np.shape(leaf))


def _per_iteration(value: Any, means: Any, loops: tuple[int, ...], where: str):
    """``(module path suffix, values, means)`` per loop iteration (one, ``""``, outside
    loops); the trailing ``loops`` axes index the iterations, the leading ones are shards."""
    if not loops:
        yield "", value, means
        return
    v = np.asarray(value, np.float64)
    m = None if means is None else np.asarray(means, np.float64)
    k = len(loops)
    if v.shape[v.ndim - k:] != loops or v.ndim < k:
        raise ValueError(f"{where} has shape {v.shape}, but its GEMM runs in loops of trip "
                         f"counts {loops} (the shape of its entry in layers): one value per "
                         "iteration in the last axes")
    if m is not None and m.shape[m.ndim - k:] != loops:
        m = None
    for idx in np.ndindex(*loops):
        yield (f"[{','.join(map(str, idx))}]", v[(..., *idx)],
               None if m is None else m[(..., *idx)])


def _items(d: Any, where: str):
    if not isinstance(d, Mapping):
        raise TypeError(f"{where} must be a dict nested "
                        "{module_path: {gemm_name: {tensor: {stat: value}}}}, "
                        f"got {type(d).__name__}")
    for k, v in d.items():
        if not isinstance(k, str):
            raise TypeError(f"{where} has a key {k!r} that is not a str")
        yield k, v


def _check_name(name: str, what: str) -> None:
    if not name or "/" in name:
        raise ValueError(f"{what}={name!r} must be a non-empty name without '/'")


class StatsLogger:
    """Writes per-GEMM statistics to TensorBoard event files and JSON lines.

    Only process 0 writes (``jax.process_index() == 0``); on the other processes every
    method does nothing and no file is created. Use it as a context manager or call
    ``close``.

    A log directory that holds logs already (a resumed run) is appended to. A run killed
    while writing a line leaves that line torn (no newline): the next logger ends it with a
    newline and warns, so no record is glued to it (``fmtkit debug`` skips the torn line).

    Args:
      logdir: the directory of the logs (created if missing).
      tensorboard: write TensorBoard event files (one scalar per tag and step).
      jsonl: write ``stats.jsonl`` (one line per logged step).
      process_index: the process this logger runs in; ``None`` asks
        ``jax.process_index()``.
      layers: the statistics state of ``fmtkit.debug.init``, for models whose GEMMs run in
        loop bodies (scanned layer stacks): each iteration of a stacked statistic is logged
        under its own tag, ``f"{module_path}[{i}]/{gemm}/{tensor}/{stat}"`` (see
        ``flatten_stats``). Without it an array value counts as per-shard values.

    Example:
      >>> import tempfile, pathlib
      >>> d = pathlib.Path(tempfile.mkdtemp())
      >>> stats = {"Dense_0": {"dot_general_0": {"activation": {"amax": 3.0}}}}
      >>> with StatsLogger(d, tensorboard=False) as log:
      ...     log.write(10, stats)
      ...     log.write(11, {"Dense_0": {"dot_general_0": {"activation":
      ...                                                   {"amax": float("nan")}}}})
      1
      0
      >>> (d / "stats.jsonl").read_text()
      '{"step": 10, "stats": {"Dense_0/dot_general_0/activation/amax": 3.0}}\\n'
    """

    def __init__(self, logdir: str | os.PathLike, *, tensorboard: bool = True,
                 jsonl: bool = True, process_index: int | None = None,
                 layers: Mapping[str, Any] | None = None):
        if not (tensorboard or jsonl):
            raise ValueError("StatsLogger needs tensorboard=True or jsonl=True")
        self.logdir = Path(logdir)
        # (the shapes only: the logger keeps no arrays of the state)
        self._layers = None if layers is None else jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(np.shape(a), np.float32), layers)
        if process_index is None:
            process_index = jax.process_index()
        self.writes = process_index == 0
        self._closed = False
        self._tb = None
        self._jsonl = None
        self._decisions = None
        if not self.writes:
            return
        self.logdir.mkdir(parents=True, exist_ok=True)
        if jsonl:
            self._jsonl = _open_append(self.logdir / JSONL_NAME)
        if tensorboard:
            # tensorboardX's synchronous writer (its FileWriter queues events for a thread and
            # its flush does not wait for the queue). The name is TensorBoard's
            # events.out.tfevents.<time>.<host>, plus the process id and a per-process count,
            # since a second logger opened in the same second would otherwise overwrite it.
            from tensorboardX.event_file_writer import EventsWriter

            suffix = f".{os.getpid()}.{next(_EVENT_FILES)}"
            self._tb = EventsWriter(str(self.logdir / "events"), suffix)

    def write(self, step: int, stats: Mapping[str, Any]) -> int:
        """Logs one step's statistics.

        Args:
          step: the training step (an int or an integer scalar array).
          stats: ``{module_path: {gemm_name: {tensor: {stat: value}}}}`` (see
            ``flatten_stats``); NaN entries are skipped.

        Returns:
          The number of values written (0 on a step that does not log, and on processes
          other than 0).
        """
        self._check_open()
        if not self.writes:
            return 0
        step = _int_step(step)
        flat = flatten_stats(stats, layers=self._layers)
        if not flat:
            return 0
        if self._jsonl is not None:
            self._jsonl.write(json.dumps({"step": step, "stats": flat}) + "\n")
            self._jsonl.flush()
        if self._tb is not None:
            from tensorboardX.proto.event_pb2 import Event
            from tensorboardX.proto.summary_pb2 import Summary

            summary = Summary(value=[Summary.Value(tag=t, simple_value=v)
                                     for t, v in flat.items()])
            self._tb.write_event(Event(wall_time=time.time(), step=step, summary=summary))
            # On disk at once, like the JSON lines: a killed run keeps every logged step (one
            # small write per logged step, not per training step).
            self._tb.flush()
        return len(flat)

    def log_decision(self, step: int, module: str, gemm: str, setting: str,
                     reason_stat: str, value: float) -> None:
        """Records a precision decision (a GEMM moved to another setting) in decisions.jsonl.

        Args:
          step: the logged step whose statistics triggered the decision, as
            ``fmtkit.debug.Decision.step`` (the new setting applies from the next step).
          module: the GEMM's module path (``""`` for the root).
          gemm: the GEMM's name in its module (``"dot_general_0"``).
          setting: the new setting, an override of ``fmtkit.debug.OVERRIDES``, e.g.
            ``"compute"``.
          reason_stat: the tag or statistic that triggered it, e.g.
            ``"activation/underflow_share"``.
          value: that statistic's value.
        """
        self._check_open()
        if not self.writes:
            return
        if self._decisions is None:
            self._decisions = _open_append(self.logdir / DECISIONS_NAME)
        record = {"step": _int_step(step), "module": str(module), "gemm": str(gemm),
                  "setting": str(setting), "stat": str(reason_stat),
                  "value": float(np.asarray(jax.device_get(value), dtype=np.float64))}
        self._decisions.write(json.dumps(record) + "\n")
        self._decisions.flush()

    def flush(self) -> None:
        """Writes buffered TensorBoard events to disk (``write`` already flushes both files)."""
        if self._tb is not None and not self._closed:
            self._tb.flush()

    def close(self) -> None:
        """Flushes and closes the files; later calls of ``write`` raise ``RuntimeError``."""
        if self._closed:
            return
        self._closed = True
        for f in (self._jsonl, self._decisions):
            if f is not None:
                f.close()
        if self._tb is not None:
            self._tb.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"StatsLogger({str(self.logdir)!r}) is closed")

    def __enter__(self) -> StatsLogger:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _open_append(path: Path):
    """``path`` opened for appending JSON lines. A file whose last line has no newline (a run
    killed while writing that line) gets one first, with a warning: the next record then
    starts on a line of its own, and the torn bytes stay in the file (readers skip them)."""
    if path.is_file() and path.stat().st_size:
        with open(path, "rb") as f:
            f.seek(-1, os.SEEK_END)
            torn = f.read(1) != b"\n"
        if torn:
            warnings.warn(f"{path} ends in a torn line (a run killed while writing it): "
                          "ended it with a newline, so the next record starts a line of its "
                          "own; readers skip the torn line.", stacklevel=3)
            with open(path, "a", encoding="utf-8") as f:
                f.write("\n")
    return open(path, "a", encoding="utf-8")


def _int_step(step: Any) -> int:
    arr = np.asarray(jax.device_get(step))
    if arr.shape != () or not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"step must be an integer scalar, got {step!r}")
    return int(arr)
