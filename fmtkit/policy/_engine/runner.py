"""Steps 2 and 3 of ``with_policy`` (``trace`` has the whole story): a trace run under a plan.

A frontend calls ``run`` with the trace it made (``trace.trace``) and the plan it resolved
(``fmtkit.policy._plan.resolve_rules``); ``run`` analyzes the trace and hands both to the
``Interpreter``, whose walk binds every equation again. ``fp8_slots`` is the analysis alone
(the delayed-FP8 state a trace needs). Nothing here resolves rules: the plan comes in whole.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax

from fmtkit.policy._engine.binding import cast, floating_dtype
from fmtkit.policy._engine.interpreter import Interpreter
from fmtkit.policy._engine.scopes import Recorder, active_recorder
from fmtkit.policy._engine.trace import Traced
from fmtkit.policy._plan import Plan


def fp8_slots(traced: Traced, plan: Plan, main: Sequence[bool | str] | None = None,
              nested: bool = False) -> dict[str, tuple[int, ...]]:
    """Shapes of the delayed-FP8 amax histories the plan needs for this trace, by slot name
    (``"<module path>:dot<i>"``; shape ``[*layers, *batch, 3, history]``: a leading axis per
    enclosing ``scan`` and per batch dimension of the dot); ``main`` and ``nested`` as in
    ``run``."""
    main = [True] * len(traced.out_avals) if main is None else main
    interp = Interpreter(plan, traced.registry)
    return interp.analyze(traced.closed, traced.params,
                          [not nested and m is True and floating_dtype(a.dtype)
                           for m, a in zip(main, traced.out_avals)]).site_shapes


def run(traced: Traced, plan: Plan, *, main: Sequence[bool | str] | None = None,
        fp8_state: dict | None = None, record: Recorder | None = None,
        nested: bool = False, warn_no_projection: bool = True
        ) -> tuple[Any, Interpreter]:
    """Interprets a trace under a plan (``fmtkit.policy._plan.resolve_rules``); returns
    (output tree, the interpreter).

    ``main``: per output leaf, True for a model output (cast to ``Rules.output_dtype``,
    searched for the head), False for state handed back (kept in its traced dtype: BatchNorm
    statistics, RNG state), a module path for a value that module sowed (as that module sees
    it: a sub-module's output reaches it cast to the sub-module's output dtype, as the ops
    it runs read it).

    ``nested``: a policied function called inside another policied model's trace. Its
    outputs are not the model's, so no matmul is the head by role (only by ``mark_head``);
    its ops are recorded (``inspect_policy``) under the enclosing model's modules.
    ``warn_no_projection``: False where the caller has already said why the rules' FP8
    recipe finds no projection.
    """
    main = [True] * len(traced.out_avals) if main is None else list(main)
    interp = Interpreter(plan, traced.registry, fp8_state=fp8_state,
                         record=record if record is not None else active_recorder(),
                         nested=nested, warn_no_projection=warn_no_projection)
    interp.analyze(traced.closed, traced.params,
                   [not nested and m is True and floating_dtype(a.dtype)
                    for m, a in zip(main, traced.out_avals)])
    # State is not a module output (no output cast applies); a sown value is read where
    # its module sowed it.
    outs = interp.run(traced.closed, traced.dyn,
                      [traced.registry.chain(m) if isinstance(m, str) else m for m in main])
    odt = plan.rules.output_dtype
    final = []
    for x, aval, is_main in zip(outs, traced.out_avals, main):
        if is_main is True:
            final.append(cast(x, odt) if odt is not None else x)
        elif isinstance(is_main, str):
            final.append(x)
        else:
            final.append(cast(x, aval.dtype))
    return jax.tree.unflatten(traced.out_tree, final), interp
