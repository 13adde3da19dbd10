"""Hugging Face Flax model objects and FP8 policies that find no projection.

A Hugging Face Flax model (``FlaxPreTrainedModel``) is not a linen module: it holds one
(``.module``), its parameters (``.params``) and its ``.config``, and its ``__call__`` takes
the parameters by keyword (``model(input_ids, attention_mask, params=params,
train=False)``, which runs ``self.module.apply({"params": params or self.params},
input_ids, attention_mask, ..., deterministic=not train, rngs=rngs)``). ``HFStyleModel``
below is written the same way (transformers is not a dependency). Expected values: the
error text, and the FP8 operands counted in the jaxpr.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jaxpr_utils import dot_operand_dtypes

from fmtkit import with_policy
from fmtkit.policy import inspect_policy

E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)


class TinyEncoder(nn.Module):
    """An embedding, two projections and a pooled classifier (the head)."""

    vocab: int = 32
    width: int = 16

    @nn.compact
    def __call__(self, input_ids, attention_mask, deterministic: bool = True):
        h = nn.Embed(self.vocab, self.width)(input_ids)
        h = nn.gelu(nn.Dense(32, name="intermediate")(h))
        h = nn.Dense(self.width, name="output")(h)
        h = nn.Dropout(0.1, deterministic=deterministic)(h)
        pooled = jnp.sum(h * attention_mask[..., None], axis=1)
        return nn.Dense(3, name="classifier")(pooled)


class Config:
    vocab_size = 32
    hidden_size = 16


class HFStyleModel:
    """Written as a ``FlaxPreTrainedModel`` subclass is: module, params and config held, the
    parameters passed to ``__call__`` by keyword."""

    def __init__(self, config, seed: int = 0, _do_init: bool = True):
        self.config = config
        self.module = TinyEncoder(config.vocab_size, config.hidden_size)
        ids = jnp.zeros((1, 4), jnp.int32)
        self.params = (self.module.init(jax.random.key(seed), ids, jnp.ones((1, 4)))["params"]
                       if _do_init else None)  # (HF's _do_init=False: parameters made later)

    def __call__(self, input_ids, attention_mask=None, params=None, dropout_rng=None,
                 train: bool = False):
        if attention_mask is None:
            attention_mask = jnp.ones(input_ids.shape, jnp.float32)
        rngs = {} if dropout_rng is None else {"dropout": dropout_rng}
        return self.module.apply({"params": params or self.params},
                                 jnp.asarray(input_ids, jnp.int32), attention_mask,
                                 deterministic=not train, rngs=rngs)


IDS = jnp.asarray(np.random.default_rng(0).integers(0, 32, (2, 4)), jnp.int32)
MASK = jnp.ones((2, 4), jnp.float32)


def test_hf_model_object_gets_a_pointer_to_the_right_wrapping():
    hf_model = HFStyleModel(Config(), _do_init=False)
    with pytest.raises(TypeError, match=r"Hugging Face Flax model.*hf_model\.module") as err:
        with_policy(hf_model, "fp8-current")
    msg = str(err.value)
    assert 'apply({"params": hf_model.params}' in msg
    assert "params=params" in msg  # the function form


@pytest.mark.slow
def test_the_wrapping_the_message_gives_runs_fp8():
    """The linen module, applied with {"params": hf_model.params}: both non-head
    projections run on E4M3 operands (the classifier is the head); the same through the
    model's own __call__ with the parameters passed positionally."""
    hf_model = HFStyleModel(Config())
    policied = with_policy(hf_model.module, "fp8-current")
    closed = jax.make_jaxpr(lambda p: policied.apply({"params": p}, IDS, MASK))(
        hf_model.params)
    assert dot_operand_dtypes(closed).count((E4M3, E4M3)) == 2
    report = inspect_policy(policied, IDS, MASK, variables={"params": hf_model.params})
    assert report.fp8_fraction() == 1.0

    call = with_policy(lambda params, ids, mask: hf_model(ids, mask, params=params),
                       "fp8-current")
    closed = jax.make_jaxpr(call)(hf_model.params, IDS, MASK)
    assert dot_operand_dtypes(closed).count((E4M3, E4M3)) == 2


def apply_fn(ids, params):
    """A user's apply with the parameters second: "auto" takes ``ids`` as the parameters."""
    h = jnp.take(params["embed"], ids, axis=0)
    return jnp.tanh(h @ params["w"]) @ params["o"]


PARAMS = {"embed": jnp.ones((32, 16)), "w": jnp.ones((16, 16)), "o": jnp.ones((16, 3))}


@pytest.mark.parametrize("preset", ["fp8-current", "nvfp4"])
def test_fp8_policy_that_finds_no_projection_warns(preset):
    policied = with_policy(apply_fn, preset)
    with pytest.warns(UserWarning, match=r"found no projection to quantize.*params_argnums"):
        jax.make_jaxpr(policied)(IDS, PARAMS)


def test_fp8_policy_with_projections_does_not_warn():
    """Control: the parameters named, the same function runs FP8 with no warning (warnings
    are errors in this suite)."""
    policied = with_policy(apply_fn, "fp8-current", params_argnums=1)
    closed = jax.make_jaxpr(policied)(IDS, PARAMS)
    assert dot_operand_dtypes(closed).count((E4M3, E4M3)) == 1
