"""The debug configuration: which GEMMs log which statistics of which tensors, when, and with
which override.

A ``DebugConfig`` is an ordered list of ``Rule``s; the first rule whose module pattern (and
optional GEMM pattern) matches a GEMM decides for it, as the policy's ``Rules`` do for
modules. Patterns are the policy's: a regex searched in the module path, ``"type:"`` for
class names, ``"subtree:"`` for a module and everything it calls. A configuration is written
in Python or loaded from a YAML or TOML file with the same fields (``DebugConfig.load``).
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from fmtkit.formats import get_format
from fmtkit.policy import Policy, Rules
from fmtkit.stats import BASE_STATS, QUANT_STATS

__all__ = ["BASE_STATS", "OVERRIDES", "QUANT_STATS", "STATS", "TENSORS", "DebugConfig",
           "Rule"]

TENSORS: tuple[str, ...] = ("activation", "weight", "output", "output_grad", "dgrad", "wgrad")
"""The six tensors of a GEMM ``output = activation · weight`` (the weight is the operand
that is a view of a parameter, the left one in Equinox's ``weight @ x``; else the rhs), with the
cotangents of the output (``output_grad``), of the activation (``dgrad``) and of the weight
(``wgrad``)."""

STATS: tuple[str, ...] = BASE_STATS + QUANT_STATS
"""Every statistic name: ``fmtkit.stats.BASE_STATS`` of every tensor and
``fmtkit.stats.QUANT_STATS`` of an operand the GEMM quantizes (activation, weight,
output_grad); their definitions are in ``fmtkit.stats``."""

QUANTIZED_TENSORS: tuple[str, ...] = ("activation", "weight", "output_grad")
"""The tensors a quantizing GEMM quantizes (``QUANT_STATS`` apply to these only)."""

OVERRIDES: tuple[str, ...] = ("compute", "current", "blockwise", "fake_quant:<format>")
"""Overrides a rule can set: ``"compute"`` runs the GEMM in its compute dtype without
quantization; ``"current"`` quantizes with per-tensor current scaling (the recipe's
formats, or E4M3 forward / E5M2 gradients for a GEMM without a recipe); ``"blockwise"``
quantizes with fine-grained current scaling, DeepSeek-V3's 1x128 activation and gradient
tiles and 128x128 weight blocks (``fmtkit.fp8.RECIPES["blockwise"]``, with the recipe's
formats, or that recipe's E4M3 throughout for a GEMM without one); ``"fake_quant:FMT"``
quantizes and dequantizes the activation, the weight (forward) and the output gradient
(backward) to the fmtkit format FMT with per-tensor current scaling around a GEMM in the
compute dtype."""

_FIELDS = ("pattern", "gemm", "tensors", "stats", "freq", "start_step", "end_step",
           "override")


def _names(value: Any, allowed: tuple[str, ...], arg: str) -> tuple[str, ...]:
    if isinstance(value, str):
        value = (value,)
    if not isinstance(value, Sequence) or not all(isinstance(v, str) for v in value):
        raise TypeError(f"{arg} must be a sequence of names from {list(allowed)}, got "
                        f"{value!r}.")
    bad = [v for v in value if v not in allowed]
    if bad:
        raise ValueError(f"{arg}: unknown name(s) {bad}; allowed: {list(allowed)}.")
    return tuple(dict.fromkeys(value))


def _int(value: Any, arg: str, minimum: int, allow_none: bool = False) -> int | None:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{arg} must be an int >= {minimum}"
                         f"{' or None' if allow_none else ''}, got {value!r}.")
    return value


def parse_override(value: str | None) -> tuple[str, str | None] | None:
    """``(kind, format name or None)`` of an override string, or None for none."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise TypeError(f"override must be a string from {list(OVERRIDES)} or None, got "
                        f"{type(value).__name__}.")
    if value in ("compute", "current", "blockwise"):
        return value, None
    if value.startswith("fake_quant:"):
        fmt = value.removeprefix("fake_quant:")
        try:
            return "fake_quant", get_format(fmt).name
        except (ValueError, TypeError) as err:
            raise ValueError(f"override={value!r}: {err}") from None
    raise ValueError(f"override must be one of {list(OVERRIDES)} (e.g. 'fake_quant:e4m3') "
                     f"or None, got {value!r}.")


@dataclasses.dataclass(frozen=True)
class Rule:
    """What the GEMMs of the matching modules log, and how they run.

    Attributes:
      pattern: a module pattern as in ``fmtkit.policy.Rules`` (regex searched in the module
        path; ``"type:"`` class names; ``"subtree:"`` a module and all it calls). ``""``
        matches every module.
      gemm: an optional regex searched in the GEMM's name within its module
        (``"dot_general_0"``); None: every GEMM of the module.
      tensors: which of ``TENSORS`` to log (``()``: none, for a rule that only overrides).
      stats: which of ``STATS`` to log; a quantization statistic is logged only for an
        operand the GEMM quantizes.
      freq: log every ``freq`` steps: at the steps ``s`` with
        ``(s - start_step) % freq == 0``.
      start_step: the first step logged.
      end_step: the last step logged (None: no end).
      override: None, or one of ``OVERRIDES``.

    Example:
      >>> rule = Rule("Dense_1", tensors=("activation",), stats=("amax",), freq=10)
      >>> bool(DebugConfig([rule]).logs_at(20)), bool(DebugConfig([rule]).logs_at(5))
      (True, False)
    """

    pattern: str = ""
    gemm: str | None = None
    tensors: tuple[str, ...] = TENSORS
    stats: tuple[str, ...] = STATS
    freq: int = 1
    start_step: int = 0
    end_step: int | None = None
    override: str | None = None

    def __post_init__(self):
        if not isinstance(self.pattern, str):
            raise TypeError(f"pattern must be a str, got {type(self.pattern).__name__}.")
        Rules([(self.pattern, Policy())])  # validates the regex
        if self.gemm is not None:
            if not isinstance(self.gemm, str):
                raise TypeError(f"gemm must be a regex string or None, got {self.gemm!r}.")
            try:
                re.compile(self.gemm)
            except re.error as err:
                raise ValueError(f"gemm: invalid regex {self.gemm!r}: {err}.") from None
        object.__setattr__(self, "tensors", _names(self.tensors, TENSORS, "tensors"))
        object.__setattr__(self, "stats", _names(self.stats, STATS, "stats"))
        _int(self.freq, "freq", 1)
        _int(self.start_step, "start_step", 0)
        _int(self.end_step, "end_step", 0, allow_none=True)
        parse_override(self.override)

    def logs_at(self, step: jax.typing.ArrayLike) -> jax.Array:
        """Whether this rule logs at ``step`` (a bool scalar; ``step`` may be traced)."""
        s = jnp.asarray(step, jnp.int32)
        on = (s >= self.start_step) & ((s - self.start_step) % self.freq == 0)
        if self.end_step is not None:
            on = on & (s <= self.end_step)
        return on


@dataclasses.dataclass(frozen=True)
class DebugConfig:
    """An ordered tuple of ``Rule``s; the first that matches a GEMM decides for it.

    A GEMM no rule matches runs as the policy says and logs nothing. Every rule must match
    at least one GEMM of the model it is used with (else ``ValueError`` naming the pattern and
    listing the GEMMs).

    Example:
      >>> cfg = DebugConfig([Rule("Dense_1", override="compute", tensors=()),
      ...                    Rule("", tensors=("activation",), stats=("amax",), freq=10)])
      >>> [bool(r.logs_at(20)) for r in cfg.rules]
      [True, True]
      >>> DebugConfig.from_dict({"rules": [{"pattern": "Dense", "freq": 5}]}).rules[0].freq
      5
    """

    rules: tuple[Rule, ...] = ()

    def __post_init__(self):
        rules = self.rules
        if isinstance(rules, Rule):
            rules = (rules,)
        if isinstance(rules, (str, Mapping)) or not isinstance(rules, Sequence):
            raise TypeError(f"rules must be a sequence of Rule, got {type(rules).__name__}.")
        for i, r in enumerate(rules):
            if not isinstance(r, Rule):
                raise TypeError(f"rules[{i}] must be a fmtkit.debug.Rule, got "
                                f"{type(r).__name__}.")
        object.__setattr__(self, "rules", tuple(rules))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> DebugConfig:
        """A configuration from ``{"rules": [{field: value}, ...]}`` (``Rule``'s fields).

        Raises:
          TypeError / ValueError: a malformed document, naming the rule and field.
        """
        if not isinstance(data, Mapping) or set(data) - {"rules"}:
            raise ValueError("a debug configuration is a mapping with the single key 'rules' "
                             f"(a list of rules), got {data!r}.")
        rules = data.get("rules", [])
        if not isinstance(rules, Sequence) or isinstance(rules, str):
            raise TypeError(f"'rules' must be a list of tables, got {type(rules).__name__}.")
        out = []
        for i, r in enumerate(rules):
            if not isinstance(r, Mapping):
                raise TypeError(f"rules[{i}] must be a table of fields, got {r!r}.")
            unknown = set(r) - set(_FIELDS)
            if unknown:
                raise ValueError(f"rules[{i}]: unknown field(s) {sorted(unknown)}; fields: "
                                 f"{list(_FIELDS)}.")
            kw = dict(r)
            for k in ("tensors", "stats"):
                if k in kw and isinstance(kw[k], list):
                    kw[k] = tuple(kw[k])
            try:
                out.append(Rule(**kw))
            except (TypeError, ValueError) as err:
                raise type(err)(f"rules[{i}]: {err}") from None
        return cls(tuple(out))

    @classmethod
    def load(cls, path: str | Path) -> DebugConfig:
        """A configuration from a YAML (``.yaml``/``.yml``) or TOML (``.toml``) file whose
        document is ``from_dict``'s (TOML: ``[[rules]]`` tables).

        Raises:
          ValueError: another suffix, a syntax error (naming the file and the line), or a
            malformed document.
        """
        path = Path(path)
        suffix = path.suffix.lower()
        if suffix in (".yaml", ".yml"):
            import yaml

            kind, parse, errors = "YAML", yaml.safe_load, yaml.YAMLError
        elif suffix == ".toml":
            import tomllib

            kind, parse, errors = "TOML", tomllib.loads, tomllib.TOMLDecodeError
        else:
            raise ValueError(f"path must end in .yaml, .yml or .toml, got {path.name!r}.")
        text = path.read_text()
        try:
            data = parse(text)
        except errors as err:
            # (PyYAML names the source "<unicode string>"; the file is named here instead)
            why = str(err).replace('in "<unicode string>", ', "")
            raise ValueError(f"{path} is not valid {kind}: {why}") from None
        return cls.from_dict(data or {})

    @functools.cached_property
    def _module_rules(self) -> tuple[Rules, ...]:
        return tuple(Rules([(r.pattern, Policy())], check_unmatched=False)
                     for r in self.rules)

    def rule_index(self, path: str, gemm: str, type_names: Sequence[str] = (),
                   ancestors: Sequence[Sequence[str]] = ()) -> int | None:
        """The index of the first rule matching the GEMM ``gemm`` of the module at
        ``path``, or None."""
        for i, (rule, rx) in enumerate(zip(self.rules, self._module_rules)):
            if rx.match(path, type_names, ancestors) is None:
                continue
            if rule.gemm is None or re.search(rule.gemm, gemm):
                return i
        return None

    def active_rules(self, step: int) -> frozenset[int]:
        """The indices of the rules that log at ``step`` (a Python int): the static
        ``active=`` argument of ``capture``, computed outside ``jax.jit``.

        Raises:
          TypeError: ``step`` is not an int.
        """
        if isinstance(step, bool) or not isinstance(step, int):
            raise TypeError(f"step must be a Python int here (outside jax.jit), got {step!r}.")
        return frozenset(i for i, r in enumerate(self.rules)
                         if r.tensors and step >= r.start_step
                         and (r.end_step is None or step <= r.end_step)
                         and (step - r.start_step) % r.freq == 0)

    def logs_at(self, step: jax.typing.ArrayLike) -> jax.Array:
        """Whether any rule that logs a tensor logs at ``step`` (a bool scalar): the flag of
        a step whose statistics are not NaN."""
        flags = [r.logs_at(step) for r in self.rules if r.tensors]
        if not flags:
            return jnp.asarray(False)
        return jnp.any(jnp.stack(flags))
