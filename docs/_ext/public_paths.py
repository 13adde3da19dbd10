"""A griffe extension for the docs build: no private module path in a rendered type.

A parameter annotated with a type alias that lives in a private module (``Hook`` in
``fmtkit.policy._gemm_hook``), or a base class defined in one, renders as a name whose
tooltip is that private path. Such an annotation or base is rendered as its plain text
instead; those naming objects defined in public modules keep their links. A public constant
whose value is a private one (``fmtkit.fp8.PARTIALS_BUDGET_BYTES``, the default of a private
switch) renders with that constant's value instead of its private name.
"""

import griffe


def _private(path: str) -> bool:
    return any(part.startswith("_") and not part.startswith("__") for part in path.split("."))


def _names(expr):
    if isinstance(expr, griffe.ExprName):
        yield expr
    if isinstance(expr, griffe.Expr):
        for sub in expr.iterate(flat=False):
            if sub is not expr:
                yield from _names(sub)


class PublicPaths(griffe.Extension):
    """Renders annotations that only resolve to private paths as plain text."""

    def on_package(self, *, pkg: griffe.Module, **kwargs) -> None:
        self._walk(pkg)

    def _walk(self, obj) -> None:
        for member in list(obj.members.values()):
            if member.is_alias:
                continue
            if member.is_function:
                for param in member.parameters:
                    param.annotation = self._plain(param.annotation)
                member.returns = self._plain(member.returns)
            if member.is_attribute:
                member.annotation = self._plain(member.annotation)
                member.value = _public_value(member.value)
            if member.is_class:
                member.bases = [self._plain(base) for base in member.bases]
            if member.is_class or member.is_module:
                self._walk(member)

    @staticmethod
    def _plain(annotation):
        if not isinstance(annotation, griffe.Expr):
            return annotation
        for name in _names(annotation):
            try:
                path = name.canonical_path
            except Exception:  # an unresolvable name renders without a path anyway
                continue
            if _private(path) and not _public_alias(name):
                return str(annotation)
        return annotation


def _public_alias(name) -> bool:
    """Whether the name is itself exported publicly (a class re-exported by its package)."""
    try:
        target = name.resolved
    except Exception:
        return False
    return target is not None and getattr(target, "is_public", False) and not _private(
        getattr(target, "path", "_"))


def _public_value(value, depth: int = 4):
    """``value``, or, where it is only the name of a constant in a private module, that
    constant's own value expression (followed at most ``depth`` names deep)."""
    name = value.last if isinstance(value, griffe.ExprAttribute) else value
    if depth == 0 or not isinstance(name, griffe.ExprName):
        return value
    try:
        path, target = name.canonical_path, name.resolved
    except Exception:  # an unresolvable name renders as written
        return value
    if not _private(path) or not getattr(target, "is_attribute", False) or target.value is None:
        return value
    return _public_value(target.value, depth - 1)
