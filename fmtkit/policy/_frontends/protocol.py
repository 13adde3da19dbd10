"""What a frontend provides: the ``Frontend`` protocol that ``with_policy`` and
``module_paths`` (``fmtkit.policy._apply``) call, each frontend being a module of this
package that implements it (``linen``, ``nnx``, ``functions``).

A frontend wraps a model so that each call traces it (``_engine.trace.trace``, the model's
module calls named by the frontend's scopes), resolves the rules against the modules it
called or holds, once (``fmtkit.policy._plan.resolve_rules``: the unmatched patterns and the
parameter dtypes are checked there too), and runs the trace under that plan
(``_engine.runner.run``): the plan is passed to the engine with each run, never stored where
the engine would look it up. The engine never imports a frontend.
"""

from __future__ import annotations

from typing import Any, Protocol

from fmtkit.policy._policy import Rules


class Frontend(Protocol):
    """One kind of model (linen module, NNX module, plain function) under a policy."""

    def wrap(self, model: Any, rules: Rules, *, strict: bool, cache_traces: bool,
             params_argnums: Any) -> Any:
        """The policied model (``with_policy``'s result); ``ValueError`` if ``model``
        already has a policy. ``params_argnums``: functions only (validated before)."""
        ...

    def collect_paths(self, model: Any, *example_inputs: Any, **kwargs: Any
                      ) -> dict[str, tuple[str, ...]]:
        """``{path: class names}`` of the model's modules (``module_paths``)."""
        ...

    def is_wrapped(self, obj: Any) -> bool:
        """Whether ``obj`` is a model this frontend has put under a policy."""
        ...
