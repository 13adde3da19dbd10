"""``keep_blocks``: keep chosen blocks of a model's layer stack out of FP8/FP4, by position.

FP4 training keeps a few linear layers in BF16, chosen by their place in the stack, not by
their names: the NVFP4 paper keeps the last blocks (12B model: the first 2 and the last 8 of
62 blocks, about 16% of the linear layers; below 15%, mostly at the end, is its advice; a
1.2B model with every layer in FP4 diverged, with the last 4 blocks in BF16 it converged:
arXiv 2509.25149 section 4.1, appendices A.1 and E.2).
"""

from __future__ import annotations

import collections
import dataclasses
import re
from collections.abc import Iterable, Mapping
from typing import Any

from fmtkit.policy._policy import Policy, Rules, as_rules

__all__ = ["find_stack", "keep_blocks"]

_INDEXED = re.compile(r"^(.*?)_(\d+)$")


def find_stack(paths: Iterable[str]) -> tuple[str, int]:
    """The model's layer stack from its module paths: ``(prefix, depth)``.

    A stack is a run of sibling modules numbered 0..L-1: linen's ``Block_0, Block_1, ...``
    (prefix ``"Block_"``) or NNX's ``blocks/0, blocks/1, ...`` (prefix ``"blocks/"``), at
    any depth (``"decoder/layers_3"``). The stack with the most members is the model's, ties
    going to the shallowest.

    Raises:
      ValueError: no numbered siblings among the paths, or a stack with gaps in its numbers.

    Example:
      >>> find_stack(["Block_0/Dense_0", "Block_1/Dense_0", "head"])
      ('Block_', 2)
    """
    found: dict[str, set[int]] = collections.defaultdict(set)
    for path in paths:
        parts = path.split("/") if path else []
        for j, part in enumerate(parts):
            head = "/".join(parts[:j])
            head = head + "/" if head else ""
            if part.isdigit():
                found[head].add(int(part))
            elif m := _INDEXED.match(part):
                found[f"{head}{m.group(1)}_"].add(int(m.group(2)))
    if not found:
        raise ValueError("No layer stack found: no module path has numbered siblings "
                         "(Block_0, Block_1 / blocks/0, blocks/1). A stack inside nn.scan has "
                         "one path for every layer; keep_blocks cannot tell its layers apart.")
    prefix = max(found, key=lambda p: (len(found[p]), -p.count("/")))
    idx = found[prefix]
    if idx != set(range(len(idx))):
        raise ValueError(f"The stack {prefix!r} has indices {sorted(idx)}, not 0..L-1.")
    return prefix, len(idx)


def _block_pattern(prefix: str, i: int) -> str:
    return f"^{re.escape(prefix)}{i}(/|$)"


def keep_blocks(rules: Any, paths: Iterable[str] | Mapping[str, Any], *, first: int = 0,
                last: int = 0, policy: Policy | str | None = None) -> Rules:
    """``rules`` with the ``first`` and ``last`` blocks of the layer stack under ``policy``.

    Args:
      rules: what ``with_policy`` accepts (a preset name such as "nvfp4", ``Rules``, ...).
      paths: the model's module paths (``fmtkit.module_paths(model, *inputs)``).
      first: how many blocks to keep at the start of the stack.
      last: how many blocks to keep at the end of the stack.
      policy: the kept blocks' policy; default: the rules' default without its FP8/FP4
        recipe (for the FP8/FP4 presets, bf16-mixed's "p=f32,c=bf16,o=bf16").

    Returns:
      ``Rules`` with one rule per kept block (``^Block_7(/|$)``) inserted before the first
      rule that carries an FP8/FP4 recipe: rules before it (norms, router) still win inside
      the kept blocks; the kept blocks win over every recipe rule and the default.

    Raises:
      ValueError: negative counts, more blocks than the stack has, no stack, no policy.

    Example:
      >>> paths = ["", "Block_0/Dense_0", "Block_1/Dense_0", "Block_2/Dense_0", "Dense_0"]
      >>> r = keep_blocks("nvfp4", paths, last=1)
      >>> r.resolve("Block_2/Dense_0").fp8 is None, r.resolve("Block_1/Dense_0").fp8.name
      (True, 'nvfp4')
    """
    rules = as_rules(rules)
    for arg, n in (("first", first), ("last", last)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"{arg} must be a non-negative int, got {n!r}.")
    prefix, depth = find_stack(list(paths))
    if first + last > depth:
        raise ValueError(f"first={first} + last={last} exceeds the {depth} blocks of the "
                         f"stack {prefix!r}.")
    if policy is None:
        if rules.default is None:
            raise ValueError("keep_blocks: these rules have no default policy; pass policy=.")
        policy = dataclasses.replace(rules.default, fp8=None)
    elif not isinstance(policy, Policy):
        policy = Policy.parse(policy)
    kept = [*range(first), *range(depth - last, depth)]
    new = [(_block_pattern(prefix, i), policy) for i in kept]
    at = next((j for j, (_, p) in enumerate(rules.rules) if p.fp8 is not None),
              len(rules.rules))
    return Rules([*rules.rules[:at], *new, *rules.rules[at:]], rules.default,
                 rules.check_unmatched, head=rules.head, output_dtype=rules.output_dtype)
