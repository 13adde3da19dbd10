"""The precision autopilot: per-GEMM thresholds on the logged statistics move a GEMM to a
safer setting for the rest of training.

``Autopilot`` is a host-side controller. After each logged step it reads the statistics
pytree (``{module_path: {gemm: {tensor: {stat}}}}``) of the quantized operands of every
GEMM it watches and, per GEMM:

* at once, when an operand has a non-finite element (``nonfinite_count > 0``) or a share of
  saturated (clipped) elements above ``saturation_share``;
* after ``patience`` consecutive logged steps on which an operand's ``underflow_share`` is
  above ``underflow_share`` or its ``sqnr_db`` below ``sqnr_db`` (a logged step below both
  thresholds resets the count),

moves the GEMM one rung up ``ladder`` (overrides of ``fmtkit.debug.Rule``: by default
first ``"blockwise"``, finer scaling with DeepSeek-V3's 1x128 / 128x128 tiles, then
``"compute"``, the compute dtype without quantization), where it stays. The
decision takes effect from the next step: ``Autopilot.config(state)`` is the
``DebugConfig`` to capture with, its override rules naming each moved GEMM by its exact
module path and GEMM name, so the model is not edited. A changed override changes the
compiled program: a step jitted with the configuration as a static argument compiles once
per distinct configuration, i.e. once at the start and once per step with a decision.

A GEMM in a loop body (a layer of an ``nn.scan`` / ``nnx.scan`` / ``lax.scan`` stack) has one
value per iteration of each statistic, and one override for all its iterations (a rule
names the GEMM, not an iteration): the worst layer decides for the stacked GEMM (the largest
non-finite count, saturation or underflow share, the smallest SQNR over the layers; a
decision records that value), and the whole stack moves.

Everything the controller knows is ``AutopilotState``, a pytree of NumPy arrays (counts,
rungs, and per rung the step, the triggering tensor and statistic and its value), so it
checkpoints with the training state and a resumed run takes the same decisions bit for bit.
The decisions are a deterministic function of the statistics: within a step the triggers
are tried in the order of ``TRIGGERS`` and the tensors in the order of ``TENSORS``.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from fmtkit.debug._config import (
    QUANTIZED_TENSORS,
    TENSORS,
    DebugConfig,
    Rule,
    parse_override,
)

__all__ = ["TRIGGERS", "Autopilot", "AutopilotState", "Decision"]

TRIGGERS: tuple[str, ...] = ("nonfinite_count", "saturation_share", "underflow_share",
                             "sqnr_db")
"""The statistics the autopilot reads, in the order it tries them within a step: the first
two act at once, the last two after ``patience`` consecutive logged steps."""

_IMMEDIATE = ("nonfinite_count", "saturation_share")

_SETTINGS = ("current", "blockwise", "fake_quant:<format>", "compute")
"""The settings a ladder's rungs take (``fmtkit.debug.OVERRIDES``), safest last."""


def _key(module_path: str, gemm: str) -> str:
    return f"{module_path}/{gemm}"


def _split(key: str) -> tuple[str, str]:
    path, _, gemm = key.rpartition("/")
    return path, gemm


class AutopilotState(NamedTuple):
    """The autopilot's state: a pytree of NumPy arrays, one entry per watched GEMM, keyed
    ``f"{module_path}/{gemm}"``.

    Attributes:
      count: int32[], consecutive logged steps with an underflow/SQNR crossing.
      rung: int32[], the GEMM's setting: 0 the policy's, ``i`` the ``ladder[i - 1]``
        override.
      moved_at: int32[len(ladder)], the step of the decision that moved the GEMM to rung
        ``i + 1`` (-1: not yet).
      tensor: int32[len(ladder)], the index in ``TENSORS`` of the operand whose statistic
        triggered that decision (-1: none).
      trigger: int32[len(ladder)], the index in ``TRIGGERS`` of that statistic (-1: none).
      value: float32[len(ladder)], its value at that step (NaN: none).
    """

    count: dict[str, np.ndarray]
    rung: dict[str, np.ndarray]
    moved_at: dict[str, np.ndarray]
    tensor: dict[str, np.ndarray]
    trigger: dict[str, np.ndarray]
    value: dict[str, np.ndarray]


@dataclasses.dataclass(frozen=True)
class Decision:
    """One move of one GEMM.

    Attributes:
      step: the logged step whose statistics triggered it (the new setting applies from the
        next step).
      module: the GEMM's module path (``""``: the root).
      gemm: the GEMM's name in its module.
      setting: the new override (an element of the autopilot's ``ladder``).
      tensor: the operand whose statistic crossed its threshold.
      stat: the statistic (from ``TRIGGERS``).
      value: the statistic's value.

    Example:
      >>> d = Decision(4, "Dense_1", "dot_general_0", "compute", "activation", "sqnr_db", 12.5)
      >>> d.step, d.setting          # decided from step 4's statistics; applies from step 5
      (4, 'compute')
    """

    step: int
    module: str
    gemm: str
    setting: str
    tensor: str
    stat: str
    value: float

    def log(self, logger: Any) -> None:
        """Records the decision with ``logger.log_decision`` (``fmtkit.debug.log.StatsLogger``):
        the reason is ``f"{tensor}/{stat}"``."""
        logger.log_decision(self.step, self.module, self.gemm, self.setting,
                            f"{self.tensor}/{self.stat}", self.value)


def _worst(value: Any, sign: int) -> float:
    """A statistic's value, or for a GEMM in a loop body (one value per iteration) the worst
    iteration's: the largest (``sign > 0``) or smallest, NaN iterations ignored (NaN if all
    are)."""
    v = np.asarray(value, np.float32).reshape(-1)
    v = v[~np.isnan(v)]
    if v.size == 0:
        return math.nan
    return float(v.max() if sign > 0 else v.min())


def _threshold(value: Any, arg: str, lo: float, hi: float) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
        raise TypeError(f"{arg} must be a float in [{lo}, {hi}] or None, got {value!r}.")
    value = float(value)
    if not math.isfinite(value) or not lo <= value <= hi:
        raise ValueError(f"{arg} must be a finite float in [{lo}, {hi}] or None, got "
                         f"{value!r}.")
    return value


@dataclasses.dataclass(frozen=True)
class Autopilot:
    """Thresholds on the logged statistics of each GEMM's quantized operands, and the
    settings a GEMM that crosses them moves to, for the rest of training.

    Attributes:
      underflow_share: count a logged step whose ``underflow_share`` (of any watched
        operand) is above this, in [0, 1]; None: not watched.
      sqnr_db: count a logged step whose ``sqnr_db`` is below this (dB, finite, in [-1000,
        1000]); None: not watched.
      saturation_share: move at once when a ``saturation_share`` is above this, in [0, 1];
        None: not watched.
      patience: the number K >= 1 of consecutive counted logged steps that moves a GEMM.
      ladder: the settings a GEMM moves through, one rung per decision: ``"current"``
        (per-tensor current scaling), ``"blockwise"`` (1x128 activation and gradient tiles,
        128x128 weight blocks, with the recipe's formats), ``"fake_quant:FMT"`` or
        ``"compute"`` (the compute dtype, no quantization); at least one, no repeats. The
        default moves a GEMM to finer scaling first, then, if its operands still cross a
        threshold there, to the compute dtype. (Under a recipe that is blockwise already
        the first rung changes nothing: give ``("compute",)``.)
      tensors: the operands watched, from ``("activation", "weight", "output_grad")``.
      pattern: the module pattern of the GEMMs watched (``fmtkit.debug.Rule.pattern``;
        ``""``: all).
      freq: log the statistics every ``freq`` steps (``fmtkit.debug.Rule``).
      start_step: the first step logged.

    A non-finite operand (``nonfinite_count > 0``) always moves its GEMM at once. A GEMM in
    a scanned layer stack (one value per layer) moves as a whole when its worst layer
    crosses a threshold (overrides apply to every iteration of a loop body).

    Example:
      >>> ap = Autopilot(underflow_share=0.1, patience=2)
      >>> st = ap.init({"Dense_0": {"dot_general_0": {}}})
      >>> hot = {"Dense_0": {"dot_general_0": {"activation": {"underflow_share": 0.5}}}}
      >>> st, d = ap.update(st, hot, step=0)
      >>> st, d = ap.update(st, hot, step=1)
      >>> d[0].setting, d[0].stat, ap.settings(st)
      ('blockwise', 'underflow_share', {'Dense_0/dot_general_0': 'blockwise'})
    """

    underflow_share: float | None = 0.05
    sqnr_db: float | None = None
    saturation_share: float | None = 0.0
    patience: int = 3
    ladder: tuple[str, ...] = ("blockwise", "compute")
    tensors: tuple[str, ...] = QUANTIZED_TENSORS
    pattern: str = ""
    freq: int = 1
    start_step: int = 0

    def __post_init__(self):
        object.__setattr__(self, "underflow_share",
                           _threshold(self.underflow_share, "underflow_share", 0.0, 1.0))
        object.__setattr__(self, "sqnr_db", _threshold(self.sqnr_db, "sqnr_db", -1000.0,
                                                       1000.0))
        object.__setattr__(self, "saturation_share",
                           _threshold(self.saturation_share, "saturation_share", 0.0, 1.0))
        if isinstance(self.patience, bool) or not isinstance(self.patience, int) or \
                self.patience < 1:
            raise ValueError(f"patience must be an int >= 1 (the number K of consecutive "
                             f"logged steps), got {self.patience!r}.")
        ladder = (self.ladder,) if isinstance(self.ladder, str) else self.ladder
        if not isinstance(ladder, Sequence) or not ladder:
            raise ValueError(f"ladder must be a non-empty sequence of settings from "
                             f"{list(_SETTINGS)}, got {self.ladder!r}.")
        for s in ladder:
            why = ""
            try:
                ok = isinstance(s, str) and parse_override(s) is not None
            except (TypeError, ValueError) as err:
                ok = False
                if s.startswith("fake_quant:"):  # a known setting with an unknown format
                    why = f" ({err})"
            if not ok:
                raise ValueError(f"ladder: unknown setting {s!r}; allowed: "
                                 f"{list(_SETTINGS)}{why}.")
        if len(set(ladder)) != len(ladder):
            raise ValueError(f"ladder: a setting appears twice in {list(ladder)}.")
        object.__setattr__(self, "ladder", tuple(ladder))
        tensors = (self.tensors,) if isinstance(self.tensors, str) else self.tensors
        if not isinstance(tensors, Sequence) or not tensors or any(
                t not in QUANTIZED_TENSORS for t in tensors):
            raise ValueError(f"tensors must be a non-empty sequence from "
                             f"{list(QUANTIZED_TENSORS)}, got {self.tensors!r}.")
        object.__setattr__(self, "tensors", tuple(dict.fromkeys(tensors)))
        # Validates pattern, freq and start_step as a Rule does.
        self._watch_rule(self.pattern)

    # -- configuration ----------------------------------------------------------------------
    @property
    def stats(self) -> tuple[str, ...]:
        """The statistics the watch rules log: ``nonfinite_count`` and those with a
        threshold."""
        on = {"nonfinite_count": True, "saturation_share": self.saturation_share is not None,
              "underflow_share": self.underflow_share is not None,
              "sqnr_db": self.sqnr_db is not None}
        return tuple(s for s in TRIGGERS if on[s])

    def _watch_rule(self, pattern: str, gemm: str | None = None,
                    override: str | None = None) -> Rule:
        try:
            return Rule(pattern, gemm=gemm, tensors=self.tensors, stats=self.stats,
                        freq=self.freq, start_step=self.start_step, override=override)
        except (TypeError, ValueError) as err:
            raise type(err)(f"Autopilot: {err}") from None

    def config(self, state: AutopilotState | None = None) -> DebugConfig:
        """The ``DebugConfig`` to capture with: one rule per moved GEMM (its exact module path
        and GEMM name, its current override, the watch statistics), then the watch rule
        (``pattern``). Equal states give equal (hashable) configurations.

        Args:
          state: the autopilot's state; None: nothing moved yet.
        """
        rules = []
        if state is not None:
            for key in sorted(state.rung):
                r = int(state.rung[key])
                if r > 0:
                    path, gemm = _split(key)
                    rules.append(self._watch_rule(f"^{re.escape(path)}$",
                                                  f"^{re.escape(gemm)}$",
                                                  self.ladder[r - 1]))
        return DebugConfig((*rules, self._watch_rule(self.pattern)))

    # -- state ------------------------------------------------------------------------------
    def init(self, stats_state: Mapping[str, Mapping[str, Any]]) -> AutopilotState:
        """The state at the start of training: every GEMM of ``stats_state`` (the
        ``fmtkit.debug.init`` pytree of ``config()``, or any pytree keyed the same way) at
        rung 0 with a zero count.

        Raises:
          TypeError: ``stats_state`` is not ``{module_path: {gemm: ...}}``.
        """
        if not isinstance(stats_state, Mapping) or not all(
                isinstance(m, Mapping) for m in stats_state.values()):
            raise TypeError("stats_state must be the statistics pytree {module_path: "
                            f"{{gemm: ...}}}} of fmtkit.debug.init, got "
                            f"{type(stats_state).__name__}.")
        keys = sorted(_key(p, g) for p, gemms in stats_state.items() for g in gemms)
        n = len(self.ladder)
        return AutopilotState(
            count={k: np.zeros((), np.int32) for k in keys},
            rung={k: np.zeros((), np.int32) for k in keys},
            moved_at={k: np.full((n,), -1, np.int32) for k in keys},
            tensor={k: np.full((n,), -1, np.int32) for k in keys},
            trigger={k: np.full((n,), -1, np.int32) for k in keys},
            value={k: np.full((n,), np.nan, np.float32) for k in keys})

    def _crossing(self, ops: Mapping[str, Any], immediate: bool
                  ) -> tuple[str, str, float] | None:
        """The first (tensor, stat, value) crossing a threshold, triggers in ``TRIGGERS``
        order then tensors in ``TENSORS`` order; only the immediate or the counted ones."""
        limits = {"nonfinite_count": (0.0, 1), "saturation_share": (self.saturation_share, 1),
                  "underflow_share": (self.underflow_share, 1), "sqnr_db": (self.sqnr_db, -1)}
        for stat in TRIGGERS:
            if (stat in _IMMEDIATE) != immediate or limits[stat][0] is None:
                continue
            limit, sign = limits[stat]
            for t in TENSORS:
                if t not in self.tensors or t not in ops or stat not in ops[t]:
                    continue
                v = _worst(ops[t][stat], sign)
                if math.isnan(v):
                    continue
                if (v > limit) if sign > 0 else (v < limit):
                    return t, stat, v
        return None

    def update(self, state: AutopilotState, stats: Mapping[str, Any], step: int
               ) -> tuple[AutopilotState, list[Decision]]:
        """Reads one step's statistics and returns the new state and the decisions taken.

        Call it after every step that logs (``DebugConfig.logs_at``); a GEMM whose
        statistics are all NaN (a step it does not log, or one it did not run in: the branch
        of ``lax.cond`` not taken) is left as it is, so calling it on
        other steps changes nothing. A GEMM at the top of the ladder, or with no quantized
        operand under its setting, takes no more decisions.

        Args:
          state: the state before the step.
          stats: the step's statistics pytree (device arrays are fetched).
          step: the step's index (an int).

        Returns:
          ``(state, decisions)``, decisions in the order of the sorted GEMM keys.

        Raises:
          TypeError: ``step`` is not an int, or ``state`` not an ``AutopilotState``.
        """
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)):
            raise TypeError(f"step must be an int, got {step!r}.")
        if not isinstance(state, AutopilotState):
            raise TypeError(f"state must be an AutopilotState, got {type(state).__name__}.")
        import jax

        stats = jax.device_get(stats)
        new = AutopilotState(*({k: np.array(v) for k, v in part.items()} for part in state))
        decisions = []
        for key in sorted(state.rung):
            path, gemm = _split(key)
            ops = stats.get(path, {}).get(gemm)
            if not ops:
                continue
            if all(np.isnan(np.asarray(v, np.float32)).all() for t in ops.values()
                   for v in t.values()):
                continue
            rung = int(new.rung[key])
            if rung >= len(self.ladder):
                continue
            hit = self._crossing(ops, immediate=True)
            if hit is None:
                counted = self._crossing(ops, immediate=False)
                if counted is None:
                    new.count[key][...] = 0
                    continue
                new.count[key][...] += 1
                if int(new.count[key]) < self.patience:
                    continue
                hit = counted
            tensor, stat, value = hit
            new.count[key][...] = 0
            new.rung[key][...] = rung + 1
            new.moved_at[key][rung] = int(step)
            new.tensor[key][rung] = TENSORS.index(tensor)
            new.trigger[key][rung] = TRIGGERS.index(stat)
            new.value[key][rung] = np.float32(value)
            decisions.append(Decision(int(step), path, gemm, self.ladder[rung], tensor, stat,
                                      float(np.float32(value))))
        return new, decisions

    def settings(self, state: AutopilotState) -> dict[str, str]:
        """``{f"{module_path}/{gemm}": setting}`` of the moved GEMMs."""
        return {k: self.ladder[int(r) - 1] for k, r in sorted(state.rung.items())
                if int(r) > 0}

    def decisions(self, state: AutopilotState) -> list[Decision]:
        """Every decision taken so far, by step then GEMM key (read back from ``state``)."""
        out = []
        for key in sorted(state.rung):
            path, gemm = _split(key)
            for i in range(int(state.rung[key])):
                out.append(Decision(int(state.moved_at[key][i]), path, gemm, self.ladder[i],
                                    TENSORS[int(state.tensor[key][i])],
                                    TRIGGERS[int(state.trigger[key][i])],
                                    float(state.value[key][i])))
        return sorted(out, key=lambda d: (d.step, d.module, d.gemm))
