"""Shared builders for the policy tests: the reference models of the test zoo (zoo.py), tiny."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import zoo
from flax import nnx
from jaxpr_utils import iter_eqns

CFG = zoo.TransformerConfig(d_model=32, num_heads=2, num_layers=1, d_ff=64, max_len=8)
MOE_TIED = dataclasses.replace(CFG, num_experts=2, tie_embeddings=True, norm="layernorm",
                               final_norm="rmsnorm")
MODEL_NAMES = ("mlp", "moe", "lm", "lm_moe_tied")
APIS = ("linen", "nnx")


@dataclasses.dataclass
class Case:
    api: str
    model: Any  # unwrapped
    inputs: tuple
    loss_fn: Callable[[Any], jax.Array]
    key: tuple = ()


# Inputs come from NumPy: no per-test compilation of random ops.
_RNG = np.random.default_rng(0)
TOKENS = jnp.asarray(_RNG.integers(0, 256, (2, CFG.max_len)), jnp.int32)
X_MLP = jnp.asarray(_RNG.standard_normal((4, 8)), jnp.float32)
X_MOE = jnp.asarray(_RNG.standard_normal((2, 4, 16)), jnp.float32)


def _mse_loss(target):
    return lambda out: jnp.mean(jnp.square(out.astype(jnp.float32) - target))


def build(api: str, name: str, **cfg_overrides) -> Case:
    """A small model of ``name`` in ``api`` with example inputs and a loss."""
    key = (api, name, tuple(sorted(cfg_overrides.items())))
    if name in ("lm", "lm_moe_tied"):
        cfg = dataclasses.replace(CFG if name == "lm" else MOE_TIED, **cfg_overrides)
        model = (zoo.TransformerLM(cfg) if api == "linen"
                 else zoo.NnxTransformerLM(cfg, rngs=nnx.Rngs(0)))
        return Case(api, model, (TOKENS,), lambda logits: zoo.lm_loss(logits, TOKENS), key)
    if name == "mlp":
        model = (zoo.Mlp((16, 6)) if api == "linen"
                 else zoo.NnxMlp(8, (16, 6), rngs=nnx.Rngs(0)))
        return Case(api, model, (X_MLP,), _mse_loss(jnp.zeros((4, 6), jnp.float32)), key)
    if name == "moe":
        model = (zoo.MoeBlock(num_experts=4, d_ff=32) if api == "linen"
                 else zoo.NnxMoeBlock(16, 32, 4, rngs=nnx.Rngs(0)))
        return Case(api, model, (X_MOE,), _mse_loss(jnp.ones((2, 4, 16), jnp.float32)), key)
    raise ValueError(name)


_PARAMS: dict = {}


def init_params(case: Case, model=None, *, abstract: bool = False):
    """linen: the "params" collection of ``model`` (default: the unwrapped model, cached).

    ``abstract``: shapes only (``jax.eval_shape``), for tests that only trace.
    """
    target = case.model if model is None else model

    def init(key, *inputs):
        return target.init(key, *inputs)["params"]

    if abstract:
        return jax.eval_shape(init, jax.random.key(2), *case.inputs)
    if model is not None:
        return jax.jit(init)(jax.random.key(2), *case.inputs)
    if case.key not in _PARAMS:
        _PARAMS[case.key] = jax.jit(init)(jax.random.key(2), *case.inputs)
    return _PARAMS[case.key]


def loss_and_grads(case: Case, model, params=None):
    """Compiled loss and parameter gradients (a nested dict) of ``model`` on the case."""
    if case.api == "linen":
        def f(p):
            return case.loss_fn(model.apply({"params": p}, *case.inputs))

        return jax.jit(jax.value_and_grad(f))(params)

    @nnx.jit
    def g(m):
        return nnx.value_and_grad(lambda mm: case.loss_fn(mm(*case.inputs)))(m)

    loss, grads = g(model)
    return loss, nnx.to_pure_dict(grads)


def dot_dtypes(jaxpr) -> set[str]:
    """``"lhs x rhs -> out"`` of every dot_general in a jaxpr and its sub-jaxprs."""
    return {f"{e.invars[0].aval.dtype} x {e.invars[1].aval.dtype} -> {e.outvars[0].aval.dtype}"
            for e in iter_eqns(jaxpr) if e.primitive.name == "dot_general"}
