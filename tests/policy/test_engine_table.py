"""The policy engine's one table of primitive handlers, and the frontends' protocol.

Each primitive with a body has one handler holding both halves of its treatment (its facts for
the analysis, its interpretation); the analysis and the interpreter both look it up in the
same table, so removing an entry makes the primitive opaque to both.
"""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
import pytest

from fmtkit.policy import with_policy
from fmtkit.policy._engine.handlers import TABLE
from fmtkit.policy._engine.walkers import Handler
from fmtkit.policy._frontends import functions, linen, nnx
from fmtkit.policy._frontends.protocol import Frontend

BF16 = jnp.dtype(jnp.bfloat16)
PARAMS = {"w": jnp.full((4, 3), 0.5, jnp.float32)}
X = jnp.linspace(-1.0, 1.0, 8, dtype=jnp.float32).reshape(2, 4)


def _branchy(params, x):
    return jax.lax.cond(jnp.sum(x) > 0, lambda x: x @ params["w"],
                        lambda x: 2.0 * (x @ params["w"]), x)


def _dot_dtypes(closed) -> list[tuple]:
    out = []

    def walk(jaxpr):
        for e in jaxpr.eqns:
            if e.primitive.name == "dot_general":
                out.append(tuple(v.aval.dtype for v in e.invars))
            for sub in jax.extend.core.jaxprs_in_params(e.params):
                walk(getattr(sub, "jaxpr", sub))

    walk(closed.jaxpr)
    return out


@pytest.mark.slow
def test_both_walkers_look_up_the_one_table(monkeypatch):
    assert all(isinstance(h, Handler) for h in TABLE.values())
    assert {"pjit", "scan", "while", "cond", "shard_map", "custom_jvp_call",
            "custom_vjp_call", "remat2"} <= set(TABLE)
    calls = []
    cond = TABLE["cond"]

    def facts(*args):
        calls.append("facts")
        return cond.facts(*args)

    def interpret(*args):
        calls.append("interpret")
        return cond.interpret(*args)

    monkeypatch.setitem(TABLE, "cond", Handler(facts=facts, interpret=interpret))
    closed = jax.make_jaxpr(with_policy(_branchy, "bf16-mixed"))(PARAMS, X)
    assert calls == ["facts", "interpret"]
    assert _dot_dtypes(closed) == [(BF16, BF16)] * 2
    # Negative control: without its entry, cond is a body the policy does not interpret.
    monkeypatch.delitem(TABLE, "cond")
    with pytest.warns(UserWarning, match="'cond' .* does not interpret"):
        closed = jax.make_jaxpr(with_policy(_branchy, "bf16-mixed"))(PARAMS, X)
    assert BF16 not in {d for pair in _dot_dtypes(closed) for d in pair}


def test_every_frontend_provides_the_protocol():
    wanted = {name: inspect.signature(getattr(Frontend, name))
              for name in ("wrap", "collect_paths", "is_wrapped")}
    for module in (linen, nnx, functions):
        for name, sig in wanted.items():
            got = inspect.signature(getattr(module, name))
            # (the protocol's methods take self; a module's functions do not)
            assert list(got.parameters) == list(sig.parameters)[1:], (module.__name__, name)
