"""The table of primitives with a body that the policy interprets: primitive name ->
``Handler`` (``walkers.Handler``: its facts for the analysis and its interpretation, each in
the module of its family). ``Analysis`` and ``Interpreter`` both look a primitive up here.
Any other primitive with a body (``pallas_call``, one this package does not know) runs as
traced, with one warning per module and primitive."""

from __future__ import annotations

from fmtkit.policy import _ops
from fmtkit.policy._engine.handlers.calls import CALL, REMAT
from fmtkit.policy._engine.handlers.cond import COND
from fmtkit.policy._engine.handlers.custom_jvp import CUSTOM_JVP
from fmtkit.policy._engine.handlers.custom_vjp import CUSTOM_VJP
from fmtkit.policy._engine.handlers.scan import SCAN
from fmtkit.policy._engine.handlers.shard_map import SHARD_MAP
from fmtkit.policy._engine.handlers.while_loop import WHILE
from fmtkit.policy._engine.walkers import Handler

TABLE: dict[str, Handler] = {
    **{name: CALL for name in _ops.INLINE_CALLS},
    **{name: REMAT for name in _ops.REMAT},
    "scan": SCAN,
    "while": WHILE,
    "cond": COND,
    "shard_map": SHARD_MAP,
    "custom_jvp_call": CUSTOM_JVP,
    "custom_vjp_call": CUSTOM_VJP,
}
