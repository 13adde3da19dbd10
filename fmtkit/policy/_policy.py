"""``Policy`` (four dtypes), ``Rules`` (ordered path-regex -> Policy) and the named presets.

Nothing here imports Flax: the frontends in ``_frontends`` read these objects.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import re
from collections.abc import Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fmtkit.formats import Format, get_format

__all__ = ["Policy", "Rules", "describe_presets", "get_preset", "list_presets"]

# Short names used by ``str(policy)`` (jmp's spelling: f32 / f16 / bf16).
_SHORT = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}
# jmp also accepts "full" for float32; "half" is float16 here on every device (jmp picks bf16 on
# TPU: a device-dependent default, which makes a policy mean different things on different
# machines).
_EXTRA_NAMES = {"full": "float32", "single": "float32"}
_KEYS = {
    "p": "param_dtype", "params": "param_dtype", "param": "param_dtype",
    "param_dtype": "param_dtype",
    "c": "compute_dtype", "compute": "compute_dtype", "compute_dtype": "compute_dtype",
    "o": "output_dtype", "output": "output_dtype", "output_dtype": "output_dtype",
    "g": "grad_dtype", "grad": "grad_dtype", "grads": "grad_dtype", "grad_dtype": "grad_dtype",
    "r": "reduce_dtype", "reduce": "reduce_dtype", "reduce_dtype": "reduce_dtype",
    "fp8": "fp8",
}
_COMPUTABLE = ("float32", "bfloat16", "float16")


def _dtype_name(value: Any, field: str) -> str:
    """Canonical format name for a Policy field; FP8/FP6/FP4 and non-floats are rejected."""
    if isinstance(value, str) and value.strip().lower() in _EXTRA_NAMES:
        return _EXTRA_NAMES[value.strip().lower()]
    try:
        fmt: Format = get_format(value)
    except (ValueError, TypeError) as err:
        raise ValueError(
            f"{field}={value!r} is not a dtype a Policy can use. Allowed: float32 (f32, fp32, "
            f"full), bfloat16 (bf16), float16 (f16, fp16, half). ({err})") from None
    if fmt.is_fp8_family:
        raise ValueError(
            f"{field}={value!r} is an {fmt.bits}-bit format ({fmt.name}); XLA cannot compute, "
            "store master weights or reduce gradients in it, so it is not a Policy dtype. "
            "FP8 matmuls are FP8 recipes (fmtkit.fp8: scaled dot_generals with E4M3/E5M2 "
            "operands and f32 accumulation), which rules will accept in place of a Policy. "
            f"Policy dtypes: {', '.join(_COMPUTABLE)}.")
    if fmt.name not in _COMPUTABLE:  # pragma: no cover - every >=16-bit format is listed
        raise ValueError(f"{field}={value!r}: allowed {', '.join(_COMPUTABLE)}.")
    return fmt.name


def _is_dtype_name(text: str) -> bool:
    try:
        get_format(text.strip())
    except (ValueError, TypeError):
        return text.strip().lower() in _EXTRA_NAMES
    return True


def is_floating(x: Any) -> bool:
    """Whether ``x`` is a floating array (JAX or NumPy)."""
    return isinstance(x, (jax.Array, np.ndarray, np.generic)) and jnp.issubdtype(
        x.dtype, jnp.floating)


@dataclasses.dataclass(frozen=True)
class Policy:
    """A mixed-precision policy: the four dtypes of one module.

    * ``param_dtype``: how parameters are stored (and created at init).
    * ``compute_dtype``: parameters and floating inputs are cast to it at use, so the module's
      matmuls take operands of this dtype.
    * ``output_dtype``: the module's floating outputs are cast to it.
    * ``grad_dtype``: the cotangent entering the module on the backward pass (the gradient of
      its output) is rounded through it. JAX ties a cotangent's dtype to its primal's, so this
      is a rounding, not a change of dtype: with ``output_dtype=bf16`` the cotangent is bf16
      anyway, and a ``grad_dtype`` wider than ``output_dtype`` changes nothing.
    * ``reduce_dtype``: the dtype in which parameter gradients are summed across data-parallel
      devices (``fmtkit.distributed``); defaults to ``param_dtype`` (gradients arrive in it).
    * ``fp8``: an FP8 recipe (a name from ``fmtkit.fp8.RECIPES`` or an ``Fp8Recipe``) for the
      module's matmul: Flax layers with a ``dot_general`` hook (linen ``Dense``,
      ``DenseGeneral``; NNX ``Linear``, ``LinearGeneral``) then run ``fmtkit.fp8.dot_general``
      on their compute-dtype operands. Other modules ignore it.

    Defaults follow jmp: params default to float32, compute follows params, output follows
    compute, and grad follows compute. The dtype fields hold ``numpy.dtype`` values, as jmp's
    do (``Policy.parse("c=bf16").compute_dtype == jnp.bfloat16``; a dtype also compares equal
    to its name, ``== "bfloat16"``), so a Policy is hashable and can be a static argument.
    Only formats XLA can compute in are accepted; FP8 formats belong to FP8 recipes.

    ``str(policy)`` round-trips through ``Policy.parse``, a customised FP8 recipe included
    (``fp8=delayed(history=16, margin=2)``: the recipe's name plus the fields that differ from
    the named recipe).

    Example:
      >>> p = Policy.parse("p=f32,c=bf16,o=f32")
      >>> p.grad_dtype == jnp.bfloat16, str(p)
      (True, 'p=f32,c=bf16,o=f32,g=bf16')
      >>> Policy.parse(str(p)) == p
      True
    """

    param_dtype: Any = "float32"  # a numpy dtype after __post_init__ (any name is accepted)
    compute_dtype: Any = None
    output_dtype: Any = None
    grad_dtype: Any = None
    reduce_dtype: Any = None
    fp8: Any = None

    def __post_init__(self):
        p = _dtype_name(self.param_dtype, "param_dtype")
        c = p if self.compute_dtype is None else _dtype_name(self.compute_dtype, "compute_dtype")
        o = c if self.output_dtype is None else _dtype_name(self.output_dtype, "output_dtype")
        g = c if self.grad_dtype is None else _dtype_name(self.grad_dtype, "grad_dtype")
        r = p if self.reduce_dtype is None else _dtype_name(self.reduce_dtype, "reduce_dtype")
        for field, name in (("param_dtype", p), ("compute_dtype", c), ("output_dtype", o),
                            ("grad_dtype", g), ("reduce_dtype", r)):
            object.__setattr__(self, field, np.dtype(name))
        if self.fp8 is not None:
            object.__setattr__(self, "fp8", _recipe(self.fp8))

    @classmethod
    def parse(cls, spec: str) -> Policy:
        """Parses ``"p=f32,c=bf16,o=f32,g=bf16"`` (jmp's grammar plus ``g=``).

        Keys: ``p``/``params``, ``c``/``compute``, ``o``/``output``, ``g``/``grad``; values:
        any name ``fmtkit.get_format`` accepts for f32/bf16/f16, plus jmp's ``full``. Missing
        keys take the defaults (params f32, compute follows params, output follows compute,
        grad follows compute). A bare dtype (``"bf16"``) sets all four.

        Raises:
          ValueError: unknown key or dtype, a repeated key, an FP8 dtype, or an empty string.
        """
        if not isinstance(spec, str):
            raise TypeError(f"Policy.parse expects a string, got {type(spec).__name__}.")
        text = spec.strip()
        if not text:
            raise ValueError("Policy.parse got an empty string; expected e.g. 'p=f32,c=bf16'.")
        if "=" not in text:
            name = _dtype_name(text, "policy")
            return cls(name, name, name, name)
        fields: dict[str, str] = {}
        for part in _split_top_level(text):
            key, sep, value = part.partition("=")
            key = key.strip().lower()
            if not sep or key not in _KEYS:
                raise ValueError(
                    f"Cannot parse {part.strip()!r} in policy {spec!r}: expected KEY=DTYPE with "
                    "KEY one of p/params, c/compute, o/output, g/grad, r/reduce, or "
                    "fp8=RECIPE.")
            field = _KEYS[key]
            if field in fields:
                raise ValueError(f"{field} is given twice in policy {spec!r}.")
            fields[field] = value.strip()
        return cls(**fields)

    def __str__(self) -> str:
        """``p=..,c=..,o=..,g=..`` plus ``r=..`` / ``fp8=RECIPE`` when they are not defaults.

        The recipe is written as ``str(recipe)``: its name, plus the fields that differ from
        the named recipe in parentheses, which ``parse`` reads back.
        """
        text = (f"p={_short(self.param_dtype)},c={_short(self.compute_dtype)},"
                f"o={_short(self.output_dtype)},g={_short(self.grad_dtype)}")
        if self.reduce_dtype != self.param_dtype:
            text += f",r={_short(self.reduce_dtype)}"
        if self.fp8 is not None:
            text += f",fp8={self.fp8}"
        return text

    # jmp-style helpers for code outside a module.
    def cast_to_param(self, tree: Any) -> Any:
        """Casts the floating leaves of ``tree`` to ``param_dtype`` (others untouched)."""
        return cast_floating(tree, self.param_dtype)

    def cast_to_compute(self, tree: Any) -> Any:
        """Casts the floating leaves of ``tree`` to ``compute_dtype`` (others untouched)."""
        return cast_floating(tree, self.compute_dtype)

    def cast_to_output(self, tree: Any) -> Any:
        """Casts the floating leaves of ``tree`` to ``output_dtype`` (others untouched)."""
        return cast_floating(tree, self.output_dtype)


def _short(dtype: np.dtype) -> str:
    return _SHORT[np.dtype(dtype).name]


def _split_top_level(text: str) -> list[str]:
    """Splits ``text`` on the commas outside parentheses (a recipe's fields are inside)."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return parts


_RECIPE_TEXT = re.compile(r"^\s*([A-Za-z0-9_.-]+)\s*\((.*)\)\s*$", re.S)


def _recipe(value: Any) -> Any:
    """An FP8 recipe from a recipe, a name, or ``str(recipe)``'s form ``NAME(field=value,
    ...)`` (fields as Python literals, applied to the named recipe, or to the default recipe
    for a name ``fmtkit.fp8.RECIPES`` lacks, as ``str`` writes them)."""
    from fmtkit import fp4 as _fp4  # no flax, no cycle: fp4/fp8 import only the core
    from fmtkit import fp8 as _fp8

    match = _RECIPE_TEXT.match(value) if isinstance(value, str) else None
    if match is None:  # FP8 and FP4 names
        return _fp4.get_recipe(value.strip() if isinstance(value, str) else value)
    name, body = match.group(1), match.group(2)
    base = _fp4.RECIPES.get(name) or _fp8.RECIPES.get(name) or _fp8.Fp8Recipe(name=name)
    try:
        call = ast.parse(f"f({body})", mode="eval").body
        if not isinstance(call, ast.Call) or call.args:
            raise ValueError("expected field=value pairs")
        fields = {kw.arg: ast.literal_eval(kw.value) for kw in call.keywords}
    except (SyntaxError, ValueError) as err:
        raise ValueError(f"Cannot parse the FP8 recipe {value!r}: expected NAME or "
                         f"NAME(field=value, ...) with Python literal values ({err}).") from None
    known = {f.name for f in dataclasses.fields(base)} - {"name"}
    unknown = sorted(set(fields) - known)
    if None in fields or unknown:
        raise ValueError(f"Cannot parse the FP8 recipe {value!r}: unknown field(s) {unknown}; "
                         f"fields: {', '.join(sorted(known))}.")
    return dataclasses.replace(base, **fields)


def _did_you_mean(name: str, names: Iterable[str]) -> str:
    """`` Did you mean 'x'?`` for a near miss (difflib; case, '_' and '-' ignored), else ''."""
    names = list(names)
    norm = {n.lower().replace("_", "-"): n for n in names}
    close = difflib.get_close_matches(name.strip().lower().replace("_", "-"), list(norm), n=1,
                                      cutoff=0.6)
    return f" Did you mean {norm[close[0]]!r}?" if close else ""


def cast_floating(tree: Any, dtype: Any, is_leaf: Any = None) -> Any:
    """Casts floating array leaves of ``tree`` to ``dtype``; other leaves are returned as is."""
    dtype = np.dtype(dtype)

    def cast(x):
        if is_floating(x) and x.dtype != dtype:
            return jnp.asarray(x).astype(dtype)
        return x

    return jax.tree.map(cast, tree, is_leaf=is_leaf)


def _as_rule_value(value: Any, where: str) -> Policy:
    """Validates the value of a rule: a Policy, a policy string, or an FP8 recipe (an
    ``Fp8Recipe``), which means f32 params, bf16 compute and that recipe's matmuls."""
    from fmtkit import fp8 as _fp8

    if isinstance(value, Policy):
        return value
    if isinstance(value, _fp8.Fp8Recipe):
        return Policy("float32", "bfloat16", fp8=value)
    if isinstance(value, str):
        return Policy.parse(value)
    raise TypeError(
        f"{where}: expected a Policy, a policy string like 'p=f32,c=bf16' or an "
        f"fmtkit.fp8.Fp8Recipe, got {type(value).__name__}.")


_TYPE_PREFIX = "type:"
_SUBTREE_PREFIX = "subtree:"


@dataclasses.dataclass(frozen=True)
class Rules:
    """An ordered list of ``(pattern, Policy)`` rules plus a default; first match wins.

    A module's path is its natural Flax path joined with ``/``: ``"Block_0/MlpBlock_0/Dense_1"``
    (linen) or ``"blocks/0/mlp/linear1"`` (NNX); the model itself is ``""`` (match it with
    ``"^$"``). ``module_paths(model, *inputs)`` lists them.

    * A pattern is a Python regex applied with ``re.search`` to the path, so ``"Dense"``
      matches anywhere in it; anchor with ``^``, ``$`` or ``(^|/)`` to be precise.
    * A pattern that starts with ``"type:"`` is searched in the module's class name and the
      names of its base classes (up to Flax's ``Module``): ``"type:^(LayerNorm|RMSNorm)$"``
      matches every Flax norm layer and user subclasses of them, whatever they are called.
    * A pattern that starts with ``"subtree:"`` (then a path or a ``type:`` pattern) matches
      the modules it names *and every module they call*: ``"subtree:type:Router$"`` gives a
      router's child ``Dense`` (its gating projection) the router's policy. The presets
      write their router rules so (``ROUTER_TYPES``, ``ROUTER_PATHS``).

    Modules no rule matches get ``default``; with ``default=None`` they run untouched.
    Rules act per operation inside each module (``fmtkit.policy`` explains the op classes): a
    module's Policy decides its matmuls' compute dtype or FP8 recipe, its outputs' dtype and
    its cotangents' rounding.

    Args:
      rules: ``(pattern, policy)`` pairs; a policy may be a ``Policy`` or its string form.
      default: the policy of unmatched modules, or None to leave them alone.
      check_unmatched: whether ``with_policy`` warns (or, with ``strict=True``, raises) when a
        pattern matches no module, naming it and listing the model's paths. The presets' own
        patterns (norms, router: ``OPTIONAL_PATTERNS``) are never reported, as they cover
        layers a model may lack; so a rule list built from a preset's (``Rules([(pattern,
        policy), *preset.rules])``, ``dataclasses.replace(preset, rules=...)``) still
        reports a pattern of its own that matches nothing (a typo).
      head: the Policy of the output head, the matmul that produces the model's outputs
        (found by its role, not its name: a tied-embedding ``attend``, a ``Dense`` called
        anything). Its ``compute_dtype`` is the matmul's operand dtype and its
        ``output_dtype`` the logits' dtype; it never runs in FP8. Applies only where the
        head's module matched no pattern (patterns override roles). None: the head is an
        ordinary matmul of its module.
      output_dtype: the dtype of the model's floating outputs (None: as computed).

    Raises:
      ValueError: an invalid regex; TypeError: a rule that is not a (str, Policy) pair.

    Example:
      >>> rules = Rules([("type:^LayerNorm$", "f32"), ("(^|/)router$", "f32")], default="c=bf16")
      >>> str(rules.resolve("Block_0/router", ("Dense",)))
      'p=f32,c=f32,o=f32,g=f32'
    """

    rules: tuple[tuple[str, Policy], ...] = ()
    default: Policy | None = None
    check_unmatched: bool = True
    head: Policy | None = None
    output_dtype: str | None = None

    def __init__(self, rules: Iterable[tuple[str, Policy | str]] = (),
                 default: Policy | str | None = None, check_unmatched: bool = True, *,
                 head: Policy | str | None = None, output_dtype: Any = None):
        if isinstance(rules, (str, bytes)) or isinstance(rules, Mapping):
            raise TypeError("rules must be a sequence of (pattern, policy) pairs, got "
                            f"{type(rules).__name__}.")
        checked = []
        for i, rule in enumerate(rules):
            if not (isinstance(rule, Sequence) and len(rule) == 2 and isinstance(rule[0], str)):
                raise TypeError(f"rules[{i}] must be a (pattern: str, policy) pair, got {rule!r}.")
            pattern, value = rule
            _compile(pattern)
            checked.append((pattern, _as_rule_value(value, f"rules[{i}] ({pattern!r})")))
        object.__setattr__(self, "rules", tuple(checked))
        object.__setattr__(self, "default", None if default is None
                           else _as_rule_value(default, "default"))
        object.__setattr__(self, "check_unmatched", bool(check_unmatched))
        head = None if head is None else _as_rule_value(head, "head")
        if head is not None and head.fp8 is not None:
            raise ValueError(f"head={head} has an FP8 recipe; the output head stays out of FP8 "
                             "(DeepSeek-V3 section 3.3, Transformer Engine): use a Policy "
                             "without fp8=.")
        object.__setattr__(self, "head", head)
        object.__setattr__(self, "output_dtype", None if output_dtype is None
                           else _dtype_name(output_dtype, "output_dtype"))

    def match(self, path: str, type_names: Sequence[str] = (),
              ancestors: Sequence[Sequence[str]] = ()) -> int | None:
        """Index of the first rule matching the module, or None. ``ancestors``: the class
        names of the modules enclosing it (for ``subtree:type:`` patterns; ``subtree:`` path
        patterns read the enclosing paths from ``path`` itself)."""
        return _match(self.rules, path, tuple(type_names), tuple(map(tuple, ancestors)))

    def resolve(self, path: str, type_names: Sequence[str] = (),
                ancestors: Sequence[Sequence[str]] = ()) -> Policy | None:
        """The policy of the module at ``path`` with class names ``type_names``."""
        i = self.match(path, type_names, ancestors)
        return self.default if i is None else self.rules[i][1]

    def unmatched(self, modules: Iterable[tuple[str, Sequence[str]]]) -> list[str]:
        """The patterns that match none of ``modules`` (pairs of path and class names)."""
        mods = [(p, tuple(t)) for p, t in modules]
        return [pat for pat, _ in self.rules
                if not any(_matches(pat, p, t) for p, t in mods)]

    def __str__(self) -> str:
        lines = [f"  {pat!r:<60} {pol}" for pat, pol in self.rules]
        lines.append(f"  {'(default)':<60} {self.default if self.default else '(unchanged)'}")
        if self.head is not None:
            lines.append(f"  {'(output head, by role)':<60} {self.head}")
        if self.output_dtype is not None:
            lines.append(f"  {'(model outputs)':<60} {_short(self.output_dtype)}")
        return "\n".join(lines)


@functools.lru_cache(maxsize=4096)
def _compile(pattern: str) -> re.Pattern:
    body = pattern.removeprefix(_SUBTREE_PREFIX)
    body = body.removeprefix(_TYPE_PREFIX)
    try:
        return re.compile(body)
    except re.error as err:
        raise ValueError(f"Invalid rule regex {pattern!r}: {err}.") from None


def _matches(pattern: str, path: str, type_names: tuple[str, ...],
             ancestors: tuple[tuple[str, ...], ...] = ()) -> bool:
    rx = _compile(pattern)
    if pattern.startswith(_SUBTREE_PREFIX):  # the module or any module enclosing it
        inner = pattern[len(_SUBTREE_PREFIX):]
        if inner.startswith(_TYPE_PREFIX):
            return any(rx.search(name) for names in (type_names, *ancestors) for name in names)
        parts = path.split("/") if path else []
        return any(rx.search("/".join(parts[:k])) is not None for k in range(len(parts) + 1))
    if pattern.startswith(_TYPE_PREFIX):
        return any(rx.search(name) for name in type_names)
    return rx.search(path) is not None


@functools.lru_cache(maxsize=65536)
def _match(rules: tuple, path: str, type_names: tuple[str, ...],
           ancestors: tuple[tuple[str, ...], ...] = ()) -> int | None:
    for i, (pattern, _) in enumerate(rules):
        if _matches(pattern, path, type_names, ancestors):
            return i
    return None


def ancestor_types(path: str, modules: Mapping[str, Sequence[str]]
                   ) -> tuple[tuple[str, ...], ...]:
    """The class names of the modules enclosing ``path`` (root first), from ``{path: class
    names}``: what ``Rules.match`` reads for ``subtree:type:`` patterns."""
    parts = path.split("/") if path else []
    prefixes = ("/".join(parts[:k]) for k in range(len(parts)))
    return tuple(tuple(modules[p]) for p in prefixes if p in modules)


def as_rules(policy_or_rules: Any) -> Rules:
    """Normalizes what ``with_policy`` accepts into ``Rules``.

    A ``Rules``; a ``Policy`` (every module); a preset name; a policy string; or a sequence of
    (pattern, policy) pairs (unmatched modules untouched).

    Example:
      >>> type(as_rules("p=f32,c=bf16")).__name__, type(as_rules("bf16-mixed")).__name__
      ('Rules', 'Rules')
    """
    if isinstance(policy_or_rules, Rules):
        return policy_or_rules
    if isinstance(policy_or_rules, Policy):
        return Rules((), default=policy_or_rules)
    if isinstance(policy_or_rules, str):
        if policy_or_rules in _PRESETS:
            return _PRESETS[policy_or_rules][1]
        if "=" not in policy_or_rules and _is_dtype_name(policy_or_rules):
            raise ValueError(
                f"{policy_or_rules!r} is a dtype, not a policy: it does not say what is stored, "
                "computed and kept in f32. Use a preset (" + ", ".join(_PRESETS) + "), e.g. "
                "'bf16-mixed' (f32 params, bf16 compute, f32 softmax/norms/logits), or say it "
                f"in full: Policy.parse('p={policy_or_rules}') for everything in "
                f"{policy_or_rules} ('pure-bf16' is that preset for bf16).")
        hint = _did_you_mean(policy_or_rules, _PRESETS) if "=" not in policy_or_rules else ""
        if hint:  # a near miss of a preset name (bf16_mixed), not a malformed policy string
            raise ValueError(f"Unknown policy preset {policy_or_rules!r}.{hint} Presets: "
                             f"{', '.join(_PRESETS)}.")
        try:
            return Rules((), default=Policy.parse(policy_or_rules))
        except ValueError as err:
            raise ValueError(
                f"{policy_or_rules!r} is neither a preset ({', '.join(_PRESETS)}) nor a policy "
                f"string like 'p=f32,c=bf16,o=f32,g=bf16': {err}") from None
    if isinstance(policy_or_rules, Sequence):
        return Rules(policy_or_rules)
    raise TypeError(
        "policy_or_rules must be a Policy, Rules, a preset name, a policy string or a list of "
        f"(pattern, policy) pairs; got {type(policy_or_rules).__name__}.")


# ---------------------------------------------------------------------------------------------
# Presets. What stays in f32 follows mixed-precision practice (softmax, LayerNorm / RMSNorm and
# the loss in f32: PyTorch autocast's f32 op list; DeepSeek-V3, arXiv 2412.19437, section 3.3)
# and, for routers (router input, logits and softmax in f32), Fedus et al. 2021, "Switch
# Transformers", section 2.4 ("Selective precision").

# Norm layers by class (Flax's and any user subclass) and by the usual names (ln, ln_1, ln_f,
# ln1, norm, norm1, final_norm, attention_norm, ffn_norm, ..., and linen's LayerNorm_0).
NORM_TYPES = "type:(LayerNorm|RMSNorm)$|^(GroupNorm|BatchNorm|InstanceNorm)$"
NORM_PATHS = (r"(^|/)(ln|norm)(_?\d+|_[a-z0-9]+)?$|(^|/)[a-z0-9]+_norm(_?\d+)?$"
              r"|(^|/)(LayerNorm|RMSNorm|GroupNorm|BatchNorm)_\d+$")
# Router / gate of a mixture of experts, with everything it calls (its gating Dense): modules
# named router, gate or gating (router_0, gate_1, ...) and classes whose name (or a base
# class's) ends in Router, Gate or Gating (V-MoE's NoisyTopExpertsPerItemRouter, flaxformer's
# TokensChooseMaskedRouter, a TopKGate). Add your own with a rule before the preset's:
# ``Rules([("subtree:type:^MyGate$", ROUTER_POLICY), *preset.rules], ...)``.
ROUTER_PATHS = r"subtree:(^|/)(router|gate|gating)(_\d+)?$"
ROUTER_TYPES = "subtree:type:(Router|Gate|Gating)$"
ROUTER_POLICY = "p=f32,c=f32,o=f32,g=f32"
# The presets' patterns cover layers a model may lack (a router, a norm by one of its usual
# names), so ``with_policy`` never reports them as matching nothing; every other pattern of a
# rule list is reported, in a list built from a preset's too (``Rules([mine,
# *preset.rules])``, ``dataclasses.replace(preset, rules=...)``).
OPTIONAL_PATTERNS = frozenset({NORM_TYPES, NORM_PATHS, ROUTER_TYPES, ROUTER_PATHS})


def _mixed(half: str) -> Rules:
    return Rules(
        [
            # Norm layers: statistics and scaling in f32 (the op classes make every norm's
            # mean/variance/rsqrt f32 anyway); the result goes back to the half stream.
            (NORM_TYPES, f"p=f32,c=f32,o={half},g={half}"),
            (NORM_PATHS, f"p=f32,c=f32,o={half},g={half}"),
            # Router: input, logits (and so the softmax in the MoE layer) in f32 (Switch).
            (ROUTER_TYPES, ROUTER_POLICY),
            (ROUTER_PATHS, ROUTER_POLICY),
        ],
        default=f"p=f32,c={half},o={half}",
        # The head: half matmul, f32 logits; its backward GEMMs take the cotangent in half.
        head=f"p=f32,c={half},o=f32,g={half}",
        output_dtype="float32",
    )


def _fp8(recipe: str) -> Rules:
    """bf16-mixed with an FP8 recipe on every projection matmul (DeepSeek-V3 section 3.3:
    embeddings, the output head, norms, the MoE router and attention's QK/PV matmuls and
    softmax stay in bf16/f32; the linear layers, attention projections included, run in
    FP8)."""
    mixed = _mixed("bf16")
    return Rules(mixed.rules, default=f"p=f32,c=bf16,o=bf16,fp8={recipe}", head=mixed.head,
                 output_dtype=mixed.output_dtype)


_FP8_PRESETS = {
    f"fp8-{name}": (f"bf16-mixed, with the FP8 recipe {name!r} (fmtkit.fp8) on every "
                    "projection matmul; embeddings, head, norms, router and attention's "
                    "QK/PV as in bf16-mixed.", _fp8(name))
    for name in ("current", "delayed", "rowwise", "blockwise", "mxfp8")
}

_FP4_PRESETS = {
    name: (f"bf16-mixed, with the FP4 recipe {name!r} (fmtkit.fp4) on every projection matmul "
           "(every block: keep the last blocks in BF16 with fmtkit.policy.keep_blocks).",
           _fp8(name))
    for name in ("nvfp4", "nvfp4-no-rht", "nvfp4-no-sr", "nvfp4-no-2d", "mxfp4")
}

_PRESETS: Mapping[str, tuple[str, Rules]] = MappingProxyType({
    "fp32": ("Everything in float32 (the reference).",
             Rules((), default="p=f32,c=f32,o=f32,g=f32")),
    "bf16-mixed": (
        "f32 params; matmuls on bf16 operands; exp/log/softmax, norm statistics, sums and the "
        "loss in f32 wherever the model writes them; router and the head's logits in f32. No "
        "loss scaling needed (bf16 has f32's range).",
        _mixed("bf16")),
    "fp16-mixed": (
        "As bf16-mixed with float16; pair it with dynamic loss scaling "
        "(fmtkit.optim.dynamic_loss_scale): fp16's 5 exponent bits underflow small gradients.",
        _mixed("f16")),
    "pure-bf16": (
        "bf16 everywhere, params stored in bf16 too: no master weights, so small updates are "
        "rounded away (1 + 1e-3 == 1 in bf16). exp/log/softmax, norm statistics and sums still "
        "run in f32 (their outputs are f32 until the next matmul).",
        Rules((), default="p=bf16,c=bf16,o=bf16,g=bf16")),
    **_FP8_PRESETS,
    **_FP4_PRESETS,
})


def list_presets() -> tuple[str, ...]:
    """Names of the named policy presets, e.g. ``("fp32", "bf16-mixed", ...)``.

    Example:
      >>> list_presets()[:4]
      ('fp32', 'bf16-mixed', 'fp16-mixed', 'pure-bf16')
    """
    return tuple(_PRESETS)


def get_preset(name: str) -> Rules:
    """The ``Rules`` of a preset.

    Raises:
      ValueError: unknown name; the message lists the presets.

    Example:
      >>> str(get_preset("bf16-mixed").resolve("Block_0/MlpBlock_0/Dense_1", ("Dense",)))
      'p=f32,c=bf16,o=bf16,g=bf16'
    """
    if not isinstance(name, str) or name not in _PRESETS:
        hint = _did_you_mean(name, _PRESETS) if isinstance(name, str) else ""
        raise ValueError(f"Unknown policy preset {name!r}.{hint} Presets: "
                         f"{', '.join(_PRESETS)}.")
    return _PRESETS[name][1]


def describe_presets() -> str:
    """A text listing of every preset with its rules (what ``fmtkit policies`` prints).

    Example:
      >>> print(describe_presets().splitlines()[0])
      fp32: Everything in float32 (the reference).
    """
    out = []
    for name, (doc, rules) in _PRESETS.items():
        out.append(f"{name}: {doc}\n{rules}")
    return "\n\n".join(out)


def is_identity(rules: Rules) -> bool:
    """Whether ``rules`` change nothing a model computes ("fp32"): every policy computes and
    outputs float32 with no FP8 recipe and no narrower gradient rounding, and so does the
    head. Under such rules every op runs in its traced dtypes (the model's own bf16 casts
    and matmuls included), and an eager call runs as the unwrapped model's does, op by op
    (not compiled as one program, which may fuse differently)."""
    f32 = np.dtype(np.float32)

    def same(p: Policy | None) -> bool:
        return p is None or (p.fp8 is None and np.dtype(p.compute_dtype) == f32
                             and np.dtype(p.output_dtype) == f32
                             and (p.grad_dtype is None or np.dtype(p.grad_dtype) == f32))

    return (all(same(p) for p in (rules.default, rules.head, *(p for _, p in rules.rules)))
            and (rules.output_dtype is None or np.dtype(rules.output_dtype) == f32))


def has_delayed_fp8(rules: Rules) -> bool:
    """Whether any policy of ``rules`` has a delayed FP8 recipe (which needs an amax state)."""
    policies = [p for _, p in rules.rules] + [rules.default]
    return any(p is not None and p.fp8 is not None and p.fp8.delayed for p in policies)
