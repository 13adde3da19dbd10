"""``Plan``: the rules resolved once against one model's module paths.

A frontend learns a model's modules once (NNX: from its graph; linen and functions: from the
modules a trace called, kept with the trace) and resolves the rules against them once, with
``resolve_rules``: each path's Policy, the rule that gave it, and the patterns that matched nothing
(reported there), the parameters checked against their modules' ``param_dtype`` there too.
The frontend then hands the plan forward to the engine with each run; nothing looks it up
again. Everything that asks "which policy does this module have" reads the plan: the
frontends (where linen ``init`` and the NNX wrapper store parameters), the interpreter (each
module's policy, the head's), and ``inspect_policy`` (the policy and rule it reports per
module). Plans are kept per (rules, modules), so a second call of the same model, or a
second trace with the same modules, resolves nothing again.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

import numpy as np

from fmtkit.policy._policy import (
    OPTIONAL_PATTERNS,
    Policy,
    Rules,
    ancestor_types,
    has_delayed_fp8,
    is_floating,
)

# Plans kept: one per (rules, module set); a process trains a few models under a few rules.
_MAX_PLANS = 256


@dataclasses.dataclass(frozen=True, eq=False)
class Plan:
    """The rules resolved against a model's module paths.

    Attributes:
      rules: the rules.
      modules: ``{path: class names}`` of the model's modules (most derived class first).
      matches: ``{path: index of the first rule that matches it}`` (None: no rule matched,
        the module gets ``rules.default``).
      unmatched: the patterns that match no module (shadowed ones included: a pattern that
        matches a module another rule took first is matched).
      delayed: whether a policy of the rules has a delayed FP8 recipe (an amax state).
    """

    rules: Rules
    modules: Mapping[str, tuple[str, ...]]
    matches: Mapping[str, int | None]
    unmatched: tuple[str, ...]
    delayed: bool
    _extra: dict = dataclasses.field(default_factory=dict, repr=False)

    @classmethod
    def of(cls, rules: Rules, modules: Mapping[str, Sequence[str]]) -> Plan:
        """The plan of ``rules`` for the modules ``{path: class names}`` (kept per pair)."""
        return _plan(rules, tuple((p, tuple(t)) for p, t in modules.items()))

    def match(self, path: str, type_names: Sequence[str] | None = None) -> int | None:
        """Index of the first rule matching the module at ``path`` (None: the default).

        ``type_names``: the module's class names when they may differ from ``modules[path]``
        (code outside every module is ``("", ())``); ancestors' names come from ``modules``.
        """
        names = self.modules.get(path) if type_names is None else tuple(type_names)
        if names is not None and self.modules.get(path) == names:
            return self.matches[path]
        key = (path, names or ())
        if key not in self._extra:
            self._extra[key] = self.rules.match(path, names or (),
                                                ancestor_types(path, self.modules))
        return self._extra[key]

    def resolve(self, path: str, type_names: Sequence[str] | None = None
                ) -> tuple[Policy | None, bool]:
        """(policy, matched by a pattern) of the module at ``path`` (``match``'s arguments)."""
        i = self.match(path, type_names)
        return (self.rules.default, False) if i is None else (self.rules.rules[i][1], True)

    def policy(self, path: str, type_names: Sequence[str] | None = None) -> Policy | None:
        """The policy of the module at ``path`` (None: it runs untouched)."""
        return self.resolve(path, type_names)[0]

    def rule(self, path: str, type_names: Sequence[str] | None = None) -> str | None:
        """The pattern that gave the module its policy (None: the default)."""
        i = self.match(path, type_names)
        return None if i is None else self.rules.rules[i][0]

    def owner(self, keys: Sequence[Any]) -> str:
        """The module a parameter belongs to, from its key names: the longest module path its
        keys start with (the root ``""`` when none), after a leading ``"params"``
        collection name."""
        names = [str(k) for k in keys]
        if names and names[0] == "params" and "params" not in self.modules:
            names = names[1:]
        for n in range(len(names) - 1, 0, -1):
            if "/".join(names[:n]) in self.modules:
                return "/".join(names[:n])
        return ""

    def report_unmatched(self, strict: bool, stacklevel: int = 4) -> None:
        """Warns (or raises with ``strict``) about the patterns that matched no module.

        The presets' own patterns (norms, router: ``OPTIONAL_PATTERNS``) are never reported:
        they cover layers a model may lack. Every other pattern is, also in a rule list
        built from a preset's (``Rules([mine, *preset.rules])``,
        ``dataclasses.replace(preset, rules=...)``), unless ``Rules.check_unmatched`` is off.
        """
        if not self.rules.check_unmatched:
            return
        missing = [p for p in self.unmatched if p not in OPTIONAL_PATTERNS]
        if not missing:
            return
        listing = "\n".join(f"  {p!r} ({t[0] if t else '?'})" for p, t in self.modules.items())
        msg = (f"Policy rule pattern(s) {missing} match no module of this model. Paths (and "
               f"class names, matched by 'type:' patterns) are:\n{listing}")
        if strict:
            raise ValueError(msg)
        warnings.warn(msg, UserWarning, stacklevel=stacklevel)

    def check_param_dtypes(self, params: Iterable[tuple[Sequence[Any], Any]], what: str
                           ) -> None:
        """Raises when a parameter is stored narrower than its module's ``param_dtype``.

        One rule for every frontend (linen ``apply``, NNX, functions): a policy never converts
        the parameters it is given. A parameter narrower than the policy's ``param_dtype`` (a
        bf16 checkpoint under a mixed preset's f32) would otherwise train in bf16 without the
        master copy the preset promises (JAX returns gradients in each parameter's own
        dtype); one of the same width but another format (f16 under ``p=bf16``) is refused
        too. Wider parameters (f32 under pure-bf16) are used as given and cast to the compute
        dtype at use.

        Args:
          params: ``(key names, leaf)`` per parameter leaf; the leaf belongs to its
            ``owner`` module.
          what: how the error names the parameters (``"variables['params']"``).
        """
        bad = []
        for keys, leaf in params:
            if not is_floating(leaf):
                continue
            module = self.owner(keys)
            policy = self.policy(module)
            if policy is None:
                continue
            want, got = np.dtype(policy.param_dtype), np.dtype(leaf.dtype)
            if got != want and got.itemsize <= want.itemsize:
                bad.append(f"{'/'.join(str(k) for k in keys)}: {got.name} (module "
                           f"{module or '<root>'!r} stores {want.name})")
        if not bad:
            return
        shown = "\n  ".join(bad[:12]) + (f"\n  ... and {len(bad) - 12} more"
                                         if len(bad) > 12 else "")
        raise ValueError(
            f"{len(bad)} parameter(s) in {what} are narrower than the policy's param_dtype:"
            f"\n  {shown}\nA policy never converts the parameters it is given (training them "
            "would skip the f32 master copy the policy promises: gradients come back in each "
            "parameter's own dtype). Cast them to the param dtype first (e.g. "
            "jax.tree.map(lambda x: x.astype(jnp.float32), params)), or choose a policy that "
            "stores them as they are (p=bf16, e.g. 'pure-bf16', with "
            "fmtkit.optim.master_weights for an f32 master copy in the optimizer).")


def resolve_rules(rules: Rules, modules: Mapping[str, Sequence[str]], *, strict: bool | None = None,
            params: Iterable[tuple[Sequence[Any], Any]] | None = None, what: str = "") -> Plan:
    """The one step between a frontend and the engine: ``rules`` resolved against a model's
    modules into the ``Plan`` the frontend hands to the engine, checked on the way.

    Args:
      rules: the rules.
      modules: ``{path: class names}`` of the model's modules (``Plan.of``).
      strict: report the patterns that match no module (``Plan.report_unmatched``): warn
        (False) or raise (True); None: not reported (the frontend reported them when it
        wrapped the model).
      params: ``(key names, leaf)`` per parameter leaf, checked against their modules'
        ``param_dtype`` (``Plan.check_param_dtypes``); None: not checked.
      what: how the error names the parameters.

    Returns:
      The plan (kept per rules and modules: a second resolution of the same pair is a look-up).

    Raises:
      ValueError: a pattern matches no module under ``strict=True``; a parameter is narrower
        than its module's ``param_dtype``.
    """
    plan = Plan.of(rules, modules)
    if strict is not None:
        plan.report_unmatched(strict, stacklevel=5)
    if params is not None:
        plan.check_param_dtypes(params, what)
    return plan


@functools.lru_cache(maxsize=_MAX_PLANS)
def _plan(rules: Rules, modules: tuple[tuple[str, tuple[str, ...]], ...]) -> Plan:
    table = dict(modules)
    matches = {path: rules.match(path, names, ancestor_types(path, table))
               for path, names in modules}
    return Plan(rules=rules, modules=MappingProxyType(table),
                matches=MappingProxyType(matches),
                unmatched=tuple(rules.unmatched(modules)), delayed=has_delayed_fp8(rules))
