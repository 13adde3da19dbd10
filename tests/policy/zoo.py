"""A zoo of small models written the way the field writes them: the core tests' models.

Each model is written in the style of a Flax repository example (our own code, tiny sizes):

* ``Lm1bDecoder`` (linen): lm1b's decoder-only LM: ``nn.Embed``, a learned positional
  embedding, Flax's multi-head self-attention with a causal mask, a Dense MLP, and a Dense
  head named ``"logitdense"``.
* ``WmtTransformer`` (linen): wmt's encoder-decoder with a shared embedding and the tied head
  ``attend(y.astype(jnp.float32)) / sqrt(d)``; attention written by hand with DenseGeneral
  q/k/v/out projections and a max-subtract / exp / sum softmax.
* ``GemmaLm`` (linen) and ``NnxGemma``: gemma's transformer: an ``Embedder`` holding a raw
  parameter (``decode`` is ``jnp.dot(x, table.T)``), Einsum q / kv / output projections,
  grouped-query attention, RoPE, an attention-logit soft cap, ``jax.nn.softmax``, RMSNorm
  written by hand, a gated-GELU MLP, and a final-logit soft cap.
* ``MnistCnn`` (linen) and ``NnxCnn``: the MNIST CNN with BatchNorm and dropout (training mode:
  mutable ``batch_stats`` / an ``nnx.Rngs`` call argument); the head is a plain ``Dense(10)``.
* ``ScanLm`` (linen): blocks stacked with ``nn.scan`` over ``{"params": 0}``.
* ``NnxLm``: a decoder with ``nnx.LinearGeneral`` projections, a hand-written max-subtract
  softmax, ``nnx.LayerNorm`` and the tied head ``embed.attend(y.astype(jnp.float32))``.
* ``NnxScanMlp``: the NNX scan-over-layers example: blocks (Linear, BatchNorm, Dropout)
  created with ``nnx.vmap`` and run with ``nnx.scan``, between an input Linear and a Linear
  head named ``logitdense``.
* ``mlp_apply``: a plain JAX MLP, ``apply(params, x)`` with hand-written ``x @ w + b``.

The reference models of the policy tests (``policy_testlib.py`` builds them tiny) are the
studies' own linen / NNX twins with Flax's natural module paths, imported from
``studies/lib/models.py``, one source for both:

* ``Mlp`` / ``NnxMlp``: a GELU MLP.
* ``MoeBlock`` / ``NnxMoeBlock``: a top-1 (Switch) mixture of experts with a ``router``.
* ``TransformerLM`` / ``NnxTransformerLM`` (``TransformerConfig``): a byte-level decoder-only
  pre-LN transformer (linen ``Block_0/ln_1``, ``Block_0/attn/query``,
  ``Block_0/MlpBlock_0/Dense_1`` or ``Block_0/MoeBlock_0/router``, ``ln_f``, ``head``; NNX
  ``blocks/0/mlp/linear1``, ``blocks/0/moe/router``, ...), dense or MoE, tied or not, with
  RMSNorm and LayerNorm, linen ``nn.scan`` / ``nn.remat``, and Flax's per-layer dtype knobs.
* ``lm_loss``: the next-byte cross entropy they train on.

``studies.lib.models`` is a leaf (it imports jax, flax and numpy, nothing of ``studies``), and
it is the only module of ``studies`` a test outside ``tests/studies`` imports
(``tests/test_layering.py``): the core's tests use the studies' models, never the studies.

The field's models are small (d_model 32-96, vocabularies 50-97, sequences 7-24, batch 2-3),
none a multiple of 128, and every vocabulary / class count (``Case.head_size``) occurs in no
other dimension of its model, so a test can tell the head's matmuls by shape. ``CASES``
describes how to build, call and train each of them.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

# The reference models, re-exported (``zoo.TransformerLM``): one source, the studies' models.
from studies.lib.models import Mlp as Mlp
from studies.lib.models import MoeBlock as MoeBlock
from studies.lib.models import NnxMlp as NnxMlp
from studies.lib.models import NnxMoeBlock as NnxMoeBlock
from studies.lib.models import NnxTransformerLM as NnxTransformerLM
from studies.lib.models import TransformerConfig as TransformerConfig
from studies.lib.models import TransformerLM as TransformerLM
from studies.lib.models import lm_loss as lm_loss

K_MASK = -2.3819763e38  # gemma's mask value: a large negative number, finite in f32.


# ---------------------------------------------------------------------------------------------
# Shared pieces


def shift_right(tokens: jax.Array) -> jax.Array:
    """lm1b / wmt: the decoder input is the target shifted right by one (0 = BOS)."""
    return jnp.pad(tokens, ((0, 0), (1, 0)))[:, :-1]


def sinusoidal_positions(length: int, features: int) -> np.ndarray:
    """wmt's fixed sinusoidal position table, [1, length, features] (computed in NumPy)."""
    pos = np.arange(length)[:, None]
    div = np.exp(np.arange(0, features, 2) * -(np.log(10_000.0) / features))
    table = np.zeros((length, features), np.float32)
    table[:, 0::2] = np.sin(pos * div)
    table[:, 1::2] = np.cos(pos * div)
    return table[None]


def apply_rope(x: jax.Array, positions: jax.Array, max_wavelength: int = 10_000) -> jax.Array:
    """gemma's rotary embedding of x [B, T, N, H] at integer positions [B, T]."""
    head_dim = x.shape[-1]
    fraction = 2 * jnp.arange(head_dim // 2, dtype=jnp.float32) / head_dim
    timescale = max_wavelength**fraction
    sinusoid = positions.astype(jnp.float32)[..., None] / timescale[None, None, :]
    sinusoid = sinusoid[..., None, :]
    sin, cos = jnp.sin(sinusoid), jnp.cos(sinusoid)
    first, second = jnp.split(x, 2, axis=-1)
    out = jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)
    return out.astype(x.dtype)


def causal_mask(length: int) -> jax.Array:
    """[1, 1, T, T] lower-triangular boolean mask."""
    return jnp.tril(jnp.ones((length, length), jnp.bool_))[None, None]


# ---------------------------------------------------------------------------------------------
# linen: lm1b-style decoder


class MlpBlock(nn.Module):
    mlp_dim: int
    dtype: Any = None

    @nn.compact
    def __call__(self, x):
        y = nn.Dense(self.mlp_dim, dtype=self.dtype)(x)
        y = nn.relu(y)
        return nn.Dense(x.shape[-1], dtype=self.dtype)(y)


class Lm1bBlock(nn.Module):
    num_heads: int
    mlp_dim: int

    @nn.compact
    def __call__(self, x, mask):
        y = nn.LayerNorm()(x)
        y = nn.MultiHeadDotProductAttention(num_heads=self.num_heads, use_bias=False,
                                            deterministic=True)(y, mask=mask)
        x = x + y
        y = nn.LayerNorm()(x)
        return x + MlpBlock(self.mlp_dim)(y)


class Lm1bDecoder(nn.Module):
    """lm1b: embed, learned positions, causal blocks, LayerNorm, Dense ``logitdense``."""

    vocab_size: int = 61
    emb_dim: int = 48
    num_heads: int = 3
    mlp_dim: int = 80
    num_layers: int = 2
    max_len: int = 24

    @nn.compact
    def __call__(self, tokens):
        length = tokens.shape[1]
        y = nn.Embed(self.vocab_size, self.emb_dim,
                     embedding_init=nn.initializers.normal(1.0), name="embed")(
                         shift_right(tokens))
        pos = self.param("pos_embedding", nn.initializers.normal(0.02),
                         (1, self.max_len, self.emb_dim))
        y = y + pos[:, :length]
        mask = causal_mask(length)
        for i in range(self.num_layers):
            y = Lm1bBlock(self.num_heads, self.mlp_dim, name=f"encoderdecoderblock_{i}")(y, mask)
        y = nn.LayerNorm(name="encoderdecoder_norm")(y)
        return nn.Dense(self.vocab_size, name="logitdense")(y)


# ---------------------------------------------------------------------------------------------
# linen: wmt-style encoder-decoder, attention by hand


class HandAttention(nn.Module):
    """Multi-head attention written out: DenseGeneral q/k/v/out, max-subtract/exp/sum."""

    num_heads: int
    dtype: Any = None

    @nn.compact
    def __call__(self, inputs_q, inputs_kv, mask):
        features = inputs_q.shape[-1]
        head_dim = features // self.num_heads
        dense = functools.partial(nn.DenseGeneral, features=(self.num_heads, head_dim),
                                  axis=-1, use_bias=False, dtype=self.dtype)
        q = dense(name="query")(inputs_q)
        k = dense(name="key")(inputs_kv)
        v = dense(name="value")(inputs_kv)
        q = q / jnp.sqrt(head_dim).astype(q.dtype)
        scores = jnp.einsum("...qhd,...khd->...hqk", q, k)
        scores = jnp.where(mask, scores, -1e10)
        scores = scores - jax.lax.stop_gradient(jnp.max(scores, axis=-1, keepdims=True))
        weights = jnp.exp(scores)
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
        out = jnp.einsum("...hqk,...khd->...qhd", weights, v)
        return nn.DenseGeneral(features, axis=(-2, -1), dtype=self.dtype, name="out")(out)


class EncoderBlock(nn.Module):
    num_heads: int
    mlp_dim: int
    dtype: Any = None

    @nn.compact
    def __call__(self, x, mask):
        y = nn.LayerNorm(dtype=self.dtype)(x)
        x = x + HandAttention(self.num_heads, self.dtype, name="self_attention")(y, y, mask)
        y = nn.LayerNorm(dtype=self.dtype)(x)
        return x + MlpBlock(self.mlp_dim, self.dtype)(y)


class DecoderBlock(nn.Module):
    num_heads: int
    mlp_dim: int
    dtype: Any = None

    @nn.compact
    def __call__(self, y, encoded, self_mask, cross_mask):
        attention = functools.partial(HandAttention, self.num_heads, self.dtype)
        z = nn.LayerNorm(dtype=self.dtype)(y)
        y = y + attention(name="self_attention")(z, z, self_mask)
        z = nn.LayerNorm(dtype=self.dtype)(y)
        y = y + attention(name="encdec_attention")(z, encoded, cross_mask)
        z = nn.LayerNorm(dtype=self.dtype)(y)
        return y + MlpBlock(self.mlp_dim, self.dtype)(z)


class WmtTransformer(nn.Module):
    """wmt: shared embedding, encoder, decoder, tied head on an explicit f32 upcast.

    ``dtype`` is wmt's ``config.dtype`` (bf16 with ``use_bfloat16``), given to every layer but
    the embedding; with it, the author's ``y.astype(jnp.float32)`` before the head is a real
    upcast (with f32 layers it is a no-op, absent from the trace). Flax's LayerNorm with a
    bf16 dtype needs "standard" dtype promotion, as the example runs.
    """

    vocab_size: int = 53
    emb_dim: int = 40
    num_heads: int = 4
    mlp_dim: int = 72
    max_len: int = 16
    dtype: Any = None

    def setup(self):
        self.shared_embedding = nn.Embed(self.vocab_size, self.emb_dim,
                                         embedding_init=nn.initializers.normal(1.0))
        self.encoder = EncoderBlock(self.num_heads, self.mlp_dim, self.dtype)
        self.encoder_norm = nn.LayerNorm(dtype=self.dtype)
        self.decoder = DecoderBlock(self.num_heads, self.mlp_dim, self.dtype)
        self.decoder_norm = nn.LayerNorm(dtype=self.dtype)
        self.pos = jnp.asarray(sinusoidal_positions(self.max_len, self.emb_dim))

    def encode(self, inputs):
        x = self.shared_embedding(inputs) + self.pos[:, :inputs.shape[1]]
        pad = (inputs > 0)[:, None, None, :]
        return self.encoder_norm(self.encoder(x, pad))

    def decode(self, encoded, inputs, targets):
        y = self.shared_embedding(shift_right(targets)) + self.pos[:, :targets.shape[1]]
        cross = (inputs > 0)[:, None, None, :]
        y = self.decoder(y, encoded, causal_mask(targets.shape[1]), cross)
        y = self.decoder_norm(y)
        # wmt: "Use the transpose of embedding matrix for logit transform."
        logits = self.shared_embedding.attend(y.astype(jnp.float32))
        return logits / jnp.sqrt(y.shape[-1])

    def __call__(self, inputs, targets):
        return self.decode(self.encode(inputs), inputs, targets)


# ---------------------------------------------------------------------------------------------
# linen: gemma-style


class RMSNorm(nn.Module):
    """RMSNorm written by hand, as gemma does."""

    @nn.compact
    def __call__(self, x):
        scale = self.param("scale", nn.initializers.zeros_init(), (x.shape[-1],))
        normed = x * jax.lax.rsqrt(jnp.mean(x**2, axis=-1, keepdims=True) + 1e-6)
        scale = jnp.expand_dims(scale, axis=range(x.ndim - 1))
        return normed * (1 + scale)


class Embedder(nn.Module):
    vocab_size: int
    embed_dim: int

    def setup(self):
        self.input_embedding = self.param("input_embedding", nn.initializers.normal(),
                                          (self.vocab_size, self.embed_dim))

    def encode(self, x):
        x = self.input_embedding[(x,)]
        return x * jnp.sqrt(self.embed_dim).astype(x.dtype)

    def decode(self, x):
        return jnp.dot(x, self.input_embedding.T)


class GemmaAttention(nn.Module):
    num_heads: int
    num_kv_heads: int
    features: int
    head_dim: int
    attn_logits_soft_cap: float | None = 50.0

    def setup(self):
        self.q_einsum = nn.Einsum((self.num_heads, self.features, self.head_dim),
                                  "BTD,NDH->BTNH", use_bias=False)
        self.kv_einsum = nn.Einsum((2, self.num_kv_heads, self.features, self.head_dim),
                                   "BSD,CKDH->CBSKH", use_bias=False)
        self.attn_vec_einsum = nn.Einsum((self.num_heads, self.head_dim, self.features),
                                         "BTNH,NHD->BTD", use_bias=False)

    def __call__(self, x, segment_pos, attn_mask):
        batch, length = x.shape[:2]
        query = self.q_einsum(x)
        key, value = self.kv_einsum(x)
        query = apply_rope(query, segment_pos) * self.head_dim**-0.5
        key = apply_rope(key, segment_pos)
        # Grouped-query attention: queries grouped per kv head, [B, T, K, G, H].
        groups = self.num_heads // self.num_kv_heads
        query = query.reshape(batch, length, self.num_kv_heads, groups, self.head_dim)
        logits = jnp.einsum("BTKGH,BSKH->BTKGS", query, key)
        if self.attn_logits_soft_cap is not None:
            logits = jnp.tanh(logits / self.attn_logits_soft_cap) * self.attn_logits_soft_cap
        logits = jnp.where(attn_mask[:, :, None, None, :], logits, K_MASK)
        probs = jax.nn.softmax(logits, axis=-1).astype(key.dtype)
        encoded = jnp.einsum("BTKGS,BSKH->BTKGH", probs, value)
        encoded = encoded.reshape(batch, length, self.num_heads, self.head_dim)
        return self.attn_vec_einsum(encoded)


class GemmaMlp(nn.Module):
    hidden_dim: int

    @nn.compact
    def __call__(self, x):
        gate = nn.Dense(self.hidden_dim, use_bias=False, name="gate_proj")(x)
        up = nn.Dense(self.hidden_dim, use_bias=False, name="up_proj")(x)
        return nn.Dense(x.shape[-1], use_bias=False, name="down_proj")(nn.gelu(gate) * up)


class GemmaBlock(nn.Module):
    num_heads: int
    num_kv_heads: int
    embed_dim: int
    head_dim: int
    hidden_dim: int

    @nn.compact
    def __call__(self, x, segment_pos, attn_mask):
        y = RMSNorm(name="pre_attention_norm")(x)
        y = GemmaAttention(self.num_heads, self.num_kv_heads, self.embed_dim, self.head_dim,
                           name="attn")(y, segment_pos, attn_mask)
        x = x + y
        y = RMSNorm(name="pre_ffw_norm")(x)
        return x + GemmaMlp(self.hidden_dim, name="mlp")(y)


class GemmaLm(nn.Module):
    """gemma: Embedder encode/decode (tied, hand-written head), GQA blocks, soft caps."""

    vocab_size: int = 97
    embed_dim: int = 64
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 24
    hidden_dim: int = 88
    num_layers: int = 2
    final_logit_softcap: float = 30.0

    @nn.compact
    def __call__(self, tokens):
        length = tokens.shape[1]
        embedder = Embedder(self.vocab_size, self.embed_dim, name="embedder")
        x = embedder.encode(shift_right(tokens))
        positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32)[None], tokens.shape)
        attn_mask = jnp.tril(jnp.ones((length, length), jnp.bool_))[None]
        for i in range(self.num_layers):
            x = GemmaBlock(self.num_heads, self.num_kv_heads, self.embed_dim, self.head_dim,
                           self.hidden_dim, name=f"layer_{i}")(x, positions, attn_mask)
        x = RMSNorm(name="final_norm")(x)
        logits = embedder.decode(x)
        logits = jnp.tanh(logits / self.final_logit_softcap) * self.final_logit_softcap
        return logits


# ---------------------------------------------------------------------------------------------
# linen: MNIST CNN with BatchNorm and dropout


class MnistCnn(nn.Module):
    """The linen MNIST CNN, with BatchNorm and dropout added (trained with mutable stats).

    Max pooling instead of the example's ``avg_pool``: Flax's ``avg_pool`` divides by a NumPy
    integer, which strict dtype promotion (the test suite's mode) rejects.
    """

    @nn.compact
    def __call__(self, x, train: bool = True):
        x = nn.Conv(features=12, kernel_size=(3, 3))(x)
        x = nn.BatchNorm(use_running_average=not train)(x)
        x = nn.max_pool(nn.relu(x), window_shape=(2, 2), strides=(2, 2))
        x = nn.Conv(features=20, kernel_size=(3, 3))(x)
        x = nn.BatchNorm(use_running_average=not train)(x)
        x = nn.max_pool(nn.relu(x), window_shape=(2, 2), strides=(2, 2))
        x = x.reshape((x.shape[0], -1))
        x = nn.relu(nn.Dense(features=36)(x))
        x = nn.Dropout(rate=0.25, deterministic=not train)(x)
        return nn.Dense(features=10)(x)


# ---------------------------------------------------------------------------------------------
# linen: nn.scan over layers


class ScanBlock(nn.Module):
    """One pre-norm block: single-head attention with jax.nn.softmax, then a gelu MLP."""

    hidden_dim: int

    @nn.compact
    def __call__(self, x, _):
        d = x.shape[-1]
        y = RMSNorm()(x)
        q = nn.Dense(d, use_bias=False, name="q")(y)
        k = nn.Dense(d, use_bias=False, name="k")(y)
        v = nn.Dense(d, use_bias=False, name="v")(y)
        scores = jnp.einsum("btd,bsd->bts", q, k) / jnp.sqrt(d).astype(q.dtype)
        length = x.shape[1]
        scores = jnp.where(jnp.tril(jnp.ones((length, length), jnp.bool_))[None], scores, -1e9)
        x = x + jnp.einsum("bts,bsd->btd", jax.nn.softmax(scores, axis=-1), v)
        y = RMSNorm()(x)
        y = nn.Dense(d, name="fc2")(nn.gelu(nn.Dense(self.hidden_dim, name="fc1")(y)))
        return x + y, None


class ScanLm(nn.Module):
    """An LM whose blocks are one ``nn.scan``; ``variable_axes`` as users write it."""

    vocab_size: int = 59
    d_model: int = 36
    hidden_dim: int = 68
    num_layers: int = 3
    variable_axes: tuple[tuple[str, int], ...] = (("params", 0),)

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(self.vocab_size, self.d_model, name="embed")(shift_right(tokens))
        stack = nn.scan(ScanBlock, variable_axes=dict(self.variable_axes),
                        split_rngs={"params": True}, length=self.num_layers)
        x, _ = stack(self.hidden_dim, name="layers")(x, None)
        x = RMSNorm(name="final_norm")(x)
        return nn.Dense(self.vocab_size, name="to_logits")(x)


class UnrolledLm(nn.Module):
    """``ScanLm`` with a Python loop instead of ``nn.scan`` (same layers, one path each)."""

    vocab_size: int = 59
    d_model: int = 36
    hidden_dim: int = 68
    num_layers: int = 3

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(self.vocab_size, self.d_model, name="embed")(shift_right(tokens))
        for i in range(self.num_layers):
            x, _ = ScanBlock(self.hidden_dim, name=f"layers_{i}")(x, None)
        x = RMSNorm(name="final_norm")(x)
        return nn.Dense(self.vocab_size, name="to_logits")(x)


# ---------------------------------------------------------------------------------------------
# NNX: gemma-style


class NnxRMSNorm(nnx.Module):
    def __init__(self, dim: int):
        self.scale = nnx.Param(jnp.zeros((dim,), jnp.float32))

    def __call__(self, x):
        var = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
        normed = x * jax.lax.rsqrt(var + 1e-6)
        return normed * (1 + jnp.expand_dims(self.scale[...], axis=range(x.ndim - 1)))


class NnxEmbedder(nnx.Module):
    def __init__(self, vocab_size: int, embed_dim: int, *, rngs: nnx.Rngs):
        self.input_embedding = nnx.Param(
            nn.initializers.normal()(rngs.params(), (vocab_size, embed_dim)))

    def encode(self, x):
        x = self.input_embedding[(x,)]
        return x * jnp.sqrt(x.shape[-1]).astype(x.dtype)

    def decode(self, x):
        return jnp.dot(x, self.input_embedding[...].T)


class NnxGemmaAttention(nnx.Module):
    def __init__(self, num_heads, num_kv_heads, features, head_dim, *, rngs: nnx.Rngs,
                 attn_logits_soft_cap: float | None = 50.0):
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.attn_logits_soft_cap = attn_logits_soft_cap
        self.q_einsum = nnx.Einsum("BTD,NDH->BTNH", (num_heads, features, head_dim), rngs=rngs)
        self.kv_einsum = nnx.Einsum("BSD,CKDH->CBSKH", (2, num_kv_heads, features, head_dim),
                                    rngs=rngs)
        self.attn_vec_einsum = nnx.Einsum("BTNH,NHD->BTD", (num_heads, head_dim, features),
                                          rngs=rngs)

    def __call__(self, x, segment_pos, attn_mask):
        query = apply_rope(self.q_einsum(x), segment_pos) * self.head_dim**-0.5
        key, value = self.kv_einsum(x)
        key = apply_rope(key, segment_pos)
        # Grouped-query attention by repeating the kv heads.
        groups = self.num_heads // self.num_kv_heads
        key = jnp.repeat(key, groups, axis=2)
        value = jnp.repeat(value, groups, axis=2)
        logits = jnp.einsum("BTNH,BSNH->BTNS", query, key)
        if self.attn_logits_soft_cap is not None:
            logits = jnp.tanh(logits / self.attn_logits_soft_cap) * self.attn_logits_soft_cap
        logits = jnp.where(attn_mask[:, :, None, :], logits, K_MASK)
        probs = jax.nn.softmax(logits, axis=-1).astype(key.dtype)
        encoded = jnp.einsum("BTNS,BSNH->BTNH", probs, value)
        return self.attn_vec_einsum(encoded)


class NnxFeedForward(nnx.Module):
    def __init__(self, features: int, hidden_dim: int, *, rngs: nnx.Rngs):
        self.gate_proj = nnx.Linear(features, hidden_dim, use_bias=False, rngs=rngs)
        self.up_proj = nnx.Linear(features, hidden_dim, use_bias=False, rngs=rngs)
        self.down_proj = nnx.Linear(hidden_dim, features, use_bias=False, rngs=rngs)

    def __call__(self, x):
        return self.down_proj(nnx.gelu(self.gate_proj(x)) * self.up_proj(x))


class NnxGemmaBlock(nnx.Module):
    def __init__(self, num_heads, num_kv_heads, embed_dim, head_dim, hidden_dim, *,
                 rngs: nnx.Rngs):
        self.pre_attention_norm = NnxRMSNorm(embed_dim)
        self.attn = NnxGemmaAttention(num_heads, num_kv_heads, embed_dim, head_dim, rngs=rngs)
        self.pre_ffw_norm = NnxRMSNorm(embed_dim)
        self.mlp = NnxFeedForward(embed_dim, hidden_dim, rngs=rngs)

    def __call__(self, x, segment_pos, attn_mask):
        x = x + self.attn(self.pre_attention_norm(x), segment_pos, attn_mask)
        return x + self.mlp(self.pre_ffw_norm(x))


class NnxGemma(nnx.Module):
    """gemma in NNX: same structure as ``GemmaLm`` (GQA by repeat instead of grouping)."""

    def __init__(self, vocab_size=83, embed_dim=48, num_heads=4, num_kv_heads=2, head_dim=20,
                 hidden_dim=72, num_layers=2, final_logit_softcap=30.0, *, rngs: nnx.Rngs):
        self.embedder = NnxEmbedder(vocab_size, embed_dim, rngs=rngs)
        self.layers = nnx.List([
            NnxGemmaBlock(num_heads, num_kv_heads, embed_dim, head_dim, hidden_dim, rngs=rngs)
            for _ in range(num_layers)])
        self.final_norm = NnxRMSNorm(embed_dim)
        self.final_logit_softcap = final_logit_softcap

    def __call__(self, tokens):
        length = tokens.shape[1]
        x = self.embedder.encode(shift_right(tokens))
        positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32)[None], tokens.shape)
        attn_mask = jnp.tril(jnp.ones((length, length), jnp.bool_))[None]
        for layer in self.layers:
            x = layer(x, positions, attn_mask)
        logits = self.embedder.decode(self.final_norm(x))
        return jnp.tanh(logits / self.final_logit_softcap) * self.final_logit_softcap


# ---------------------------------------------------------------------------------------------
# NNX: decoder with LinearGeneral projections and a tied attend head


class NnxHandAttention(nnx.Module):
    def __init__(self, features: int, num_heads: int, *, rngs: nnx.Rngs):
        head_dim = features // num_heads
        self.head_dim = head_dim
        proj = functools.partial(nnx.LinearGeneral, features, (num_heads, head_dim),
                                 use_bias=False, rngs=rngs)
        self.query, self.key, self.value = proj(), proj(), proj()
        self.out = nnx.LinearGeneral((num_heads, head_dim), features, axis=(-2, -1), rngs=rngs)

    def __call__(self, x, mask):
        q = self.query(x) / jnp.sqrt(self.head_dim).astype(x.dtype)
        k, v = self.key(x), self.value(x)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k)
        scores = jnp.where(mask, scores, -1e10)
        scores = scores - jax.lax.stop_gradient(scores.max(axis=-1, keepdims=True))
        weights = jnp.exp(scores)
        weights = weights / weights.sum(axis=-1, keepdims=True)
        return self.out(jnp.einsum("bhqk,bkhd->bqhd", weights, v))


class NnxDecoderBlock(nnx.Module):
    def __init__(self, features: int, num_heads: int, mlp_dim: int, *, rngs: nnx.Rngs):
        self.ln1 = nnx.LayerNorm(features, rngs=rngs)
        self.attn = NnxHandAttention(features, num_heads, rngs=rngs)
        self.ln2 = nnx.LayerNorm(features, rngs=rngs)
        self.fc1 = nnx.Linear(features, mlp_dim, rngs=rngs)
        self.fc2 = nnx.Linear(mlp_dim, features, rngs=rngs)

    def __call__(self, x, mask):
        x = x + self.attn(self.ln1(x), mask)
        return x + self.fc2(nnx.relu(self.fc1(self.ln2(x))))


class NnxLm(nnx.Module):
    """A decoder LM: nnx.Embed, LinearGeneral attention by hand, tied ``attend`` head."""

    def __init__(self, vocab_size=67, features=32, num_heads=2, mlp_dim=56, num_layers=2,
                 max_len=24, *, rngs: nnx.Rngs):
        self.embed = nnx.Embed(vocab_size, features, rngs=rngs)
        self.pos_embedding = nnx.Param(
            nn.initializers.normal(0.02)(rngs.params(), (1, max_len, features)))
        self.blocks = nnx.List([NnxDecoderBlock(features, num_heads, mlp_dim, rngs=rngs)
                                for _ in range(num_layers)])
        self.final_norm = nnx.LayerNorm(features, rngs=rngs)

    def __call__(self, tokens):
        length = tokens.shape[1]
        x = self.embed(shift_right(tokens)) + self.pos_embedding[:, :length]
        mask = causal_mask(length)
        for block in self.blocks:
            x = block(x, mask)
        y = self.final_norm(x)
        return self.embed.attend(y.astype(jnp.float32))


# ---------------------------------------------------------------------------------------------
# NNX: MNIST CNN


class NnxCnn(nnx.Module):
    """The NNX MNIST CNN with BatchNorm, dropout taking an ``nnx.Rngs`` call argument."""

    def __init__(self, *, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(1, 12, kernel_size=(3, 3), rngs=rngs)
        self.batch_norm1 = nnx.BatchNorm(12, rngs=rngs)
        self.conv2 = nnx.Conv(12, 20, kernel_size=(3, 3), rngs=rngs)
        self.batch_norm2 = nnx.BatchNorm(20, rngs=rngs)
        self.linear1 = nnx.Linear(3 * 3 * 20, 36, rngs=rngs)
        self.dropout = nnx.Dropout(rate=0.25)
        self.linear2 = nnx.Linear(36, 10, rngs=rngs)

    def __call__(self, x, rngs: nnx.Rngs | None = None):
        pool = functools.partial(nnx.max_pool, window_shape=(2, 2), strides=(2, 2))
        x = pool(nnx.relu(self.batch_norm1(self.conv1(x))))
        x = pool(nnx.relu(self.batch_norm2(self.conv2(x))))
        x = x.reshape(x.shape[0], -1)
        x = self.dropout(nnx.relu(self.linear1(x)), rngs=rngs)
        return self.linear2(x)


# ---------------------------------------------------------------------------------------------
# NNX: scan over layers


class NnxScanBlock(nnx.Module):
    def __init__(self, dim: int, *, rngs: nnx.Rngs):
        self.linear = nnx.Linear(dim, dim, rngs=rngs)
        self.bn = nnx.BatchNorm(dim, rngs=rngs)
        self.dropout = nnx.Dropout(0.1, rngs=rngs)

    def __call__(self, x):
        return jax.nn.gelu(self.dropout(self.bn(self.linear(x))))


class NnxScanMlp(nnx.Module):
    """Blocks created with ``nnx.vmap`` and applied with ``nnx.scan`` (the NNX example)."""

    def __init__(self, in_dim=24, dim=40, n_layers=3, num_classes=7, *, rngs: nnx.Rngs):
        self.embed_in = nnx.Linear(in_dim, dim, rngs=rngs)

        @nnx.split_rngs(splits=n_layers)
        @nnx.vmap(axis_size=n_layers)
        def create_block(rngs: nnx.Rngs):
            return NnxScanBlock(dim, rngs=rngs)

        self.layers = create_block(rngs)
        self.logitdense = nnx.Linear(dim, num_classes, rngs=rngs)

    def __call__(self, x):
        @nnx.scan
        def scan_fn(x, block):
            return block(x), None

        x, _ = scan_fn(self.embed_in(x), self.layers)
        return self.logitdense(x)


# ---------------------------------------------------------------------------------------------
# Plain JAX


def mlp_init(key: jax.Array, sizes=(24, 44, 44, 7)) -> list[dict[str, jax.Array]]:
    """Parameters of ``mlp_apply``: a list of {"w", "b"} layers (LeCun-normal weights)."""
    params = []
    keys = jax.random.split(key, len(sizes) - 1)
    for k, (fan_in, fan_out) in zip(keys, itertools.pairwise(sizes)):
        w = jax.random.normal(k, (fan_in, fan_out), jnp.float32) / np.sqrt(fan_in)
        params.append({"w": w, "b": jnp.zeros((fan_out,), jnp.float32)})
    return params


def mlp_apply(params, x):
    """A plain JAX MLP: hand-written ``x @ w + b`` and gelu; the last layer gives logits."""
    for layer in params[:-1]:
        x = jax.nn.gelu(x @ layer["w"] + layer["b"][None, :])
    return x @ params[-1]["w"] + params[-1]["b"][None, :]


# ---------------------------------------------------------------------------------------------
# Cases: how to build, call and train each model


def xent(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Mean softmax cross-entropy, the loss every example trains with."""
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


@dataclasses.dataclass(frozen=True)
class Case:
    """One zoo model and a batch.

    Attributes:
      name: the case's id.
      api: "linen", "nnx" or "jax".
      build: returns a fresh unwrapped model (linen module, NNX module, or apply function).
      inputs: positional call inputs (after the params for "jax").
      labels: integer targets of the logits (the model's output).
      head_size: the vocabulary / class count: it appears only in the head's matmuls.
      train_kwargs: keyword call arguments in training mode (linen: e.g. ``train=True``).
      mutable: linen collections updated in training (e.g. ``("batch_stats",)``).
      rng_names: linen rng streams the call needs (e.g. ``("dropout",)``).
      call_rngs: NNX: the model takes ``rngs=nnx.Rngs(dropout=...)`` as a call argument.
      n_projections: forward matmuls with a parameter operand outside the head, counted by
        hand per traced body (a scan body counts once).
      n_attention: forward activation x activation matmuls (QK^T, PV), per traced body.
      stacked: layers are one ``nn.scan`` / ``nnx.scan``.
      init_params: "jax" only: the parameter pytree's builder.
      lr: an SGD learning rate with which 5 steps on the batch lower the loss.
    """

    name: str
    api: str
    build: Callable[[], Any]
    inputs: tuple
    labels: jax.Array
    head_size: int
    train_kwargs: tuple = ()
    mutable: tuple = ()
    rng_names: tuple = ()
    call_rngs: bool = False
    n_projections: int = 0
    n_attention: int = 0
    stacked: bool = False
    init_params: Callable[[jax.Array], Any] | None = None
    lr: float = 0.1

    def __str__(self) -> str:
        return self.name


_RNG = np.random.default_rng(0)


def _tokens(batch: int, length: int, vocab: int) -> jax.Array:
    # A learnable pattern with 10% noise so that a few SGD steps lower the loss.
    base = (np.arange(length)[None] * 3 + np.arange(batch)[:, None]) % (vocab - 1) + 1
    noise = _RNG.integers(1, vocab, (batch, length))
    return jnp.asarray(np.where(_RNG.random((batch, length)) < 0.1, noise, base), jnp.int32)


LM1B_TOKENS = _tokens(2, 12, 61)
WMT_SRC, WMT_TGT = _tokens(3, 9, 53), _tokens(3, 7, 53)
GEMMA_TOKENS = _tokens(2, 16, 97)
NNX_GEMMA_TOKENS = _tokens(2, 14, 83)
SCAN_TOKENS = _tokens(2, 10, 59)
NNX_LM_TOKENS = _tokens(3, 11, 67)
IMAGES = jnp.asarray(_RNG.standard_normal((3, 12, 12, 1)), jnp.float32)
IMAGE_LABELS = jnp.asarray([3, 7, 1], jnp.int32)
FEATURES = jnp.asarray(_RNG.standard_normal((3, 24)), jnp.float32)
FEATURE_LABELS = jnp.asarray([0, 4, 6], jnp.int32)

CASES = {
    "linen_lm1b": Case(
        "linen_lm1b", "linen", Lm1bDecoder, (LM1B_TOKENS,), LM1B_TOKENS, 61,
        n_projections=2 * (4 + 2), n_attention=2 * 2),
    "linen_wmt": Case(
        "linen_wmt", "linen", WmtTransformer, (WMT_SRC, WMT_TGT), WMT_TGT, 53,
        n_projections=3 * 4 + 2 * 2, n_attention=3 * 2),
    "linen_gemma": Case(
        "linen_gemma", "linen", GemmaLm, (GEMMA_TOKENS,), GEMMA_TOKENS, 97,
        n_projections=2 * (3 + 3), n_attention=2 * 2),
    "linen_cnn": Case(
        "linen_cnn", "linen", MnistCnn, (IMAGES,), IMAGE_LABELS, 10,
        train_kwargs=(("train", True),), mutable=("batch_stats",), rng_names=("dropout",),
        n_projections=1, lr=0.03),
    "linen_scan": Case(
        "linen_scan", "linen", ScanLm, (SCAN_TOKENS,), SCAN_TOKENS, 59,
        n_projections=5, n_attention=2, stacked=True),
    "nnx_gemma": Case(
        "nnx_gemma", "nnx", lambda: NnxGemma(rngs=nnx.Rngs(0)), (NNX_GEMMA_TOKENS,),
        NNX_GEMMA_TOKENS, 83, n_projections=2 * (3 + 3), n_attention=2 * 2),
    "nnx_lm": Case(
        "nnx_lm", "nnx", lambda: NnxLm(rngs=nnx.Rngs(0)), (NNX_LM_TOKENS,), NNX_LM_TOKENS, 67,
        n_projections=2 * (4 + 2), n_attention=2 * 2, lr=0.05),
    "nnx_cnn": Case(
        "nnx_cnn", "nnx", lambda: NnxCnn(rngs=nnx.Rngs(0)), (IMAGES,), IMAGE_LABELS, 10,
        call_rngs=True, n_projections=1, lr=0.03),
    "nnx_scan": Case(
        "nnx_scan", "nnx", lambda: NnxScanMlp(rngs=nnx.Rngs(0)), (FEATURES,), FEATURE_LABELS, 7,
        n_projections=2, stacked=True),
    "jax_mlp": Case(
        "jax_mlp", "jax", lambda: mlp_apply, (FEATURES,), FEATURE_LABELS, 7,
        n_projections=2, init_params=lambda key: mlp_init(key)),
}


# ---------------------------------------------------------------------------------------------
# The training loss as a pure function, and training


def fp8_state_type():
    """The NNX Variable type holding delayed-FP8 histories (None if the policy has none)."""
    import fmtkit.policy

    return getattr(fmtkit.policy, "DelayedScalingVariable", None)


def batch(case: Case, key: int = 0) -> dict:
    """The data of one step: inputs, labels and a dropout key (a traced input, not a const)."""
    return {"inputs": case.inputs, "labels": case.labels, "key": jax.random.key(key)}


def _warm_up(case: Case, model: nnx.Module) -> None:
    """One call outside any transform: creates an NNX policy's delayed-FP8 state (lazily
    created at the first call, as fmtkit documents)."""
    kw = {"rngs": nnx.Rngs(dropout=123)} if case.call_rngs else {}
    model(*case.inputs, **kw)


def functional(case: Case, model: Any, *, key: int = 0, warmup: bool = False,
               abstract: bool = False):
    """``(forward, diff, aux)``: the training-mode forward pass as a pure function of pytrees.

    ``forward(diff, aux, batch) -> (logits, new_aux)``. ``diff`` is ``{"params": ...,
    "fp8_state": ...}`` (what is differentiated: the trainable parameters and, under a
    delayed FP8 recipe, the amax histories, whose "gradient" is the observed amaxes);
    ``aux`` is the rest of the state (linen ``batch_stats``; NNX batch statistics and rng
    counters), updated by training-mode calls. ``model`` is the unwrapped or wrapped model
    (for "jax": the apply function). ``warmup``: NNX: call the model once first (delayed FP8).
    ``abstract``: linen and "jax": ``diff`` and ``aux`` as ``jax.ShapeDtypeStruct``s (enough
    to trace; nothing is compiled or run).
    """
    if case.api == "linen":
        kw = dict(case.train_kwargs)
        rngs = {"params": jax.random.key(key), **{n: jax.random.key(key + 1)
                                                   for n in case.rng_names}}
        init = functools.partial(model.init, **kw)
        if abstract:  # shapes and dtypes only: nothing is compiled or run
            variables = jax.eval_shape(init, rngs, *case.inputs)
        else:  # jitted: one compile instead of an eager dispatch (and a compile) per operation
            variables = jax.jit(init)(rngs, *case.inputs)
        diff = {"params": variables["params"], "fp8_state": variables.get("fp8_state", {})}
        aux = {k: v for k, v in variables.items() if k not in diff}

        def forward(diff, aux, batch):
            variables = {"params": diff["params"], **aux}
            if diff["fp8_state"]:
                variables["fp8_state"] = diff["fp8_state"]
            rngs = {n: batch["key"] for n in case.rng_names} or None
            if case.mutable:
                logits, updates = model.apply(variables, *batch["inputs"], rngs=rngs,
                                              mutable=list(case.mutable), **kw)
                return logits, {**aux, **updates}
            return model.apply(variables, *batch["inputs"], rngs=rngs, **kw), aux

        return forward, diff, aux

    if case.api == "nnx":
        fp8_type = fp8_state_type()
        fp8_filter = fp8_type if fp8_type is not None else nnx.Not(...)
        if warmup:
            _warm_up(case, model)
        graphdef, params, fp8, aux = nnx.split(model, nnx.Param, fp8_filter, ...)

        def forward(diff, aux, batch):
            m = nnx.merge(graphdef, diff["params"], diff["fp8_state"], aux, copy=True)
            kw = {"rngs": nnx.Rngs(dropout=batch["key"])} if case.call_rngs else {}
            return m(*batch["inputs"], **kw), nnx.split(m, nnx.Param, fp8_filter, ...)[3]

        return forward, {"params": params, "fp8_state": fp8}, aux

    init = case.init_params
    params = jax.eval_shape(init, jax.random.key(key)) if abstract else init(jax.random.key(key))
    # A policied function under a delayed FP8 recipe takes its amax histories explicitly.
    init_fp8 = getattr(model, "init_fp8_state", lambda *a: {})
    fp8 = init_fp8(params, *case.inputs)

    def forward(diff, aux, batch):
        kw = {"fp8_state": diff["fp8_state"]} if fp8 else {}
        return model(diff["params"], *batch["inputs"], **kw), aux

    return forward, {"params": params, "fp8_state": fp8}, {}


def training_loss(forward: Callable) -> Callable:
    """``loss_fn(diff, aux, batch) -> (loss, new_aux)`` from ``functional``'s forward."""
    def loss_fn(diff, aux, batch):
        logits, aux = forward(diff, aux, batch)
        return xent(logits, batch["labels"]), aux

    return loss_fn


@dataclasses.dataclass(frozen=True)
class Traced:
    """The jaxprs of one training step of a case (see ``trace``)."""

    train: Any  # ClosedJaxpr of (loss, parameter gradients), the cotangent seed an input
    forward: Any  # ClosedJaxpr of the loss alone
    records: list  # jaxpr_utils.Labeled for every equation of ``train``
    grad_labels: list  # labels of the parameter-gradient outputs
    logits: jax.ShapeDtypeStruct

    def matmuls(self, head_size: int):
        from jaxpr_utils import matmuls

        return matmuls(self.records, self.grad_labels, head_size)


def trace(case: Case, model: Any, *, warmup: bool = False) -> Traced:
    """Traces ``value_and_grad`` of the case's training loss, labelled for the checks.

    The step is ``jax.vjp`` with the cotangent seed as an explicit input (what
    ``jax.value_and_grad`` computes, with its literal 1.0 made an argument), so the backward
    pass is the part that depends on it. Parameters are labelled ``PARAM``, the batch
    ``DATA``, the seed ``COTANGENT`` (``jaxpr_utils.label_eqns``).
    """
    from jaxpr_utils import COTANGENT, DATA, PARAM, label_eqns

    forward, diff, aux = functional(case, model, warmup=warmup, abstract=True)
    loss_fn = training_loss(forward)
    data = batch(case)

    def step(diff, aux, data, ct):
        loss, pullback, _ = jax.vjp(lambda d: loss_fn(d, aux, data), diff, has_aux=True)
        return loss, pullback(ct)[0]["params"]

    ct = jnp.ones((), jnp.float32)
    train = jax.make_jaxpr(step)(diff, aux, data, ct)
    labels = ({"params": jax.tree.map(lambda _: {PARAM}, diff["params"]),
               "fp8_state": jax.tree.map(lambda _: set(), diff["fp8_state"])},
              jax.tree.map(lambda _: set(), aux), jax.tree.map(lambda _: {DATA}, data),
              {COTANGENT})
    flat = jax.tree.leaves(labels, is_leaf=lambda x: isinstance(x, set))
    assert len(flat) == len(train.jaxpr.invars), (len(flat), len(train.jaxpr.invars))
    records, outs = label_eqns(train, flat)
    fwd = jax.make_jaxpr(lambda d, a, b: loss_fn(d, a, b)[0])(diff, aux, data)
    logits = jax.eval_shape(lambda d, a, b: forward(d, a, b)[0], diff, aux, data)
    return Traced(train, fwd, records, outs[1:], logits)


def sgd_train(case: Case, model: Any, *, steps: int = 5, lr: float | None = None,
              update_fp8: Callable | None = None):
    """Losses of ``steps`` jitted SGD steps on one batch (the functional form, any API).

    ``update_fp8(state, observed)`` records the amaxes (``fmtkit.fp8.update_state``).
    Returns ``(losses, diff)``.
    """
    forward, diff, aux = functional(case, model, warmup=update_fp8 is not None)
    loss_fn = training_loss(forward)
    lr = case.lr if lr is None else lr

    @jax.jit
    def step(diff, aux, data):
        (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(diff, aux, data)
        params = jax.tree.map(lambda p, g: p - lr * g, diff["params"], grads["params"])
        fp8 = diff["fp8_state"]
        if update_fp8 is not None:
            fp8 = update_fp8(fp8, grads["fp8_state"])
        return {"params": params, "fp8_state": fp8}, aux, loss

    losses = []
    for i in range(steps):
        diff, aux, loss = step(diff, aux, batch(case, i))
        losses.append(float(loss))
    return losses, diff


def nnx_optimizer_train(case: Case, model: nnx.Module, *, steps: int = 5, lr: float | None = None,
                        update_fp8: Callable | None = None) -> list[float]:
    """NNX the way users train: ``nnx.Optimizer`` + ``nnx.value_and_grad`` under ``nnx.jit``."""
    fp8_type = fp8_state_type()
    if update_fp8 is not None:
        _warm_up(case, model)
    opt = nnx.Optimizer(model, optax.sgd(case.lr if lr is None else lr), wrt=nnx.Param)
    wrt = nnx.DiffState(0, (nnx.Param, fp8_type) if fp8_type is not None else nnx.Param)

    @nnx.jit
    def step(model, opt, data):
        def loss(m):
            kw = {"rngs": nnx.Rngs(dropout=data["key"])} if case.call_rngs else {}
            return xent(m(*data["inputs"], **kw), data["labels"])

        value, grads = nnx.value_and_grad(loss, argnums=wrt)(model)
        if fp8_type is not None:
            g_params, g_fp8 = nnx.split_state(grads, nnx.Param, fp8_type)
            if update_fp8 is not None:
                nnx.update(model, update_fp8(nnx.state(model, fp8_type), g_fp8))
        else:
            g_params = grads
        opt.update(model, g_params)
        return value

    return [float(step(model, opt, batch(case, i))) for i in range(steps)]
