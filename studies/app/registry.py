"""The command line's studies and benchmarks, found in their own modules.

Every public module (a name without a leading ``_``) of a registered folder declares what
the command line lists, as module constants written as literals::

    NAME = "fp8-outliers"       # the command-line id (fmtkit study NAME, fmtkit bench NAME)
    SUMMARY = "per-tensor vs row vs 1x128 block vs MX scaling as outlier channels grow"
    ORDER = 6                   # studies only: the place in `fmtkit study --list`

The constants are read from the source (``ast``), without importing the module, so listing
stays fast and a module that forgets them fails here, naming the module and the constants,
rather than vanishing from the list. No table is kept by hand: adding a module to the folder
registers it.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import pkgutil
from pathlib import Path

__all__ = ["Entry", "discover"]


@dataclasses.dataclass(frozen=True)
class Entry:
    """One registered module.

    Attributes:
      name: its command-line id (``NAME``).
      summary: one line for the listing (``SUMMARY``).
      module: its dotted module name (``studies.numerics.format_ranges``).
      order: its place in the listing (``ORDER``; 0 where the folder does not ask for one).
    """

    name: str
    summary: str
    module: str
    order: int = 0


def _constants(path: Path) -> dict[str, object]:
    """The module-level ``NAME = literal`` assignments of a source file."""
    out = {}
    for node in ast.parse(path.read_text(), filename=str(path)).body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                if isinstance(t, ast.Name) and t.id.isupper() and node.value is not None:
                    try:
                        out[t.id] = ast.literal_eval(node.value)
                    except ValueError:
                        pass
    return out


def _modules(packages: tuple[str, ...]) -> list[tuple[str, pkgutil.ModuleInfo]]:
    out = []
    for package in packages:
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise ValueError(f"packages must be importable packages, got {package!r}.")
        out += [(package, info) for info in pkgutil.iter_modules(spec.submodule_search_locations)]
    return out


def discover(*packages: str, ordered: bool = False) -> list[Entry]:
    """The modules of ``packages`` that the command line lists, in listing order.

    Args:
      packages: dotted package names (``"studies.numerics"``).
      ordered: the modules also declare ``ORDER`` (an int); the list is sorted by it (then by
        name), else by name.

    Raises:
      TypeError: a public module of the package lacks ``NAME`` or ``SUMMARY`` (or ``ORDER``
        when ``ordered``), or declares one of them with the wrong type (the message names
        the module and what it must declare).
      ValueError: two modules declare the same ``NAME``, or a name in ``packages`` is not a
        package.
    """
    required = {"NAME": str, "SUMMARY": str, **({"ORDER": int} if ordered else {})}
    entries: dict[str, Entry] = {}
    for package, info in _modules(packages):
        if info.name.startswith("_") or info.ispkg:
            continue
        module = f"{package}.{info.name}"
        path = Path(info.module_finder.path) / f"{info.name}.py"  # type: ignore[union-attr]
        found = _constants(path)
        bad = [k for k, kind in required.items()
               if not isinstance(found.get(k), kind) or isinstance(found.get(k), bool)]
        if bad:
            wanted = ", ".join(f"{k} ({kind.__name__})" for k, kind in required.items())
            raise TypeError(f"{module} must declare the module constants {wanted} as "
                            f"literals (the command line lists it by them); missing or "
                            f"wrong: {', '.join(bad)}.")
        name = found["NAME"]
        if name in entries:
            raise ValueError(f"{module} and {entries[name].module} both declare "
                             f"NAME = {name!r}.")
        entries[name] = Entry(name, found["SUMMARY"], module,  # type: ignore[arg-type]
                              found.get("ORDER", 0) if ordered else 0)  # type: ignore[arg-type]
    return sorted(entries.values(), key=lambda e: (e.order, e.name))
