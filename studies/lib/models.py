"""Small reference models for the studies, the benchmarks and the core's tests: linen and NNX
twins.

A leaf module: it imports jax, flax and numpy and nothing of ``studies``, so the test zoo
(``tests/policy/zoo.py``) builds the policy tests' reference models from it without importing
the application (``tests/test_layering.py`` checks both).

* ``Mlp`` / ``NnxMlp``: a GELU MLP.
* ``MoeBlock`` / ``NnxMoeBlock``: a top-1 (Switch) mixture of experts with a router named
  ``router``. Every expert is computed densely and the top-1 expert's output is selected,
  which is exact top-1 routing (no capacity, no dropped tokens) at E x the FLOPs: fine at
  these sizes.
* ``TransformerLM`` / ``NnxTransformerLM``: a byte-level (vocab 256) decoder-only pre-LN
  transformer: token + learned position embeddings, ``Block``s of ``ln_1`` -> causal
  multi-head attention ``attn`` (Flax's own) -> residual, ``ln_2`` -> MLP or MoE -> residual,
  then ``ln_f`` and a ``head`` (or the tied embedding).

Module paths are the natural Flax ones: linen ``Block_0/MlpBlock_0/Dense_1``,
``Block_0/MoeBlock_0/router``, ``Block_0/attn/query``, ``ln_f``, ``head``; NNX
``blocks/0/mlp/linear1``, ``blocks/0/moe/router``, ``blocks/0/attn/query``, ``ln_f``, ``head``.

``TransformerConfig.outlier_scale`` (off by default) multiplies the outputs of every block's
``ln_1`` and ``ln_2`` by a fixed per-channel vector: the normalized residual stream that the
blocks' input GEMMs (attention query/key/value, the MLP's first Dense, the MoE router and
experts) read then has outlier channels, as a large norm scale gives them in LLMs
(``studies.lib.regimes.OutlierFeatures`` builds the vector and documents its sources).

The models are written as users write them: no precision logic beyond Flax's per-layer
``dtype``/``param_dtype`` arguments, which ``TransformerConfig`` exposes so a mixed-precision
model can also be written "by hand" (the baseline of ``studies/bench/policy.py``). Outputs
of a block are added in whatever dtype the layers return, so under a policy the residual
stream is the compute dtype.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence
from typing import Any, Literal

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

__all__ = [
    "Block",
    "Mlp",
    "MlpBlock",
    "MoeBlock",
    "NnxBlock",
    "NnxMlp",
    "NnxMlpBlock",
    "NnxMoeBlock",
    "NnxTransformerLM",
    "TransformerConfig",
    "TransformerLM",
    "count_params",
    "lm_loss",
    "random_tokens",
]

Dtype = Any


def _dt(name: str | None) -> Any:
    return None if name is None else jnp.dtype(name)


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    """Configuration of ``TransformerLM`` / ``NnxTransformerLM`` (hashable).

    Attributes:
      vocab_size: 256 (bytes).
      d_model, num_heads, num_layers, d_ff, max_len: the usual sizes.
      num_experts: 0 for dense MLP blocks, E > 0 for a top-1 MoE in every block.
      norm: the blocks' ``ln_1``/``ln_2`` ("rmsnorm" or "layernorm"); ``final_norm``: ``ln_f``.
        The defaults use both kinds.
      tie_embeddings: logits from ``embed.attend`` instead of a ``head`` layer.
      scan_layers, remat: linen only: stack the blocks with ``nn.scan`` (module ``blocks``)
        and/or wrap them in ``nn.remat``.
      dtype: compute dtype passed to every layer (None: Flax infers it from inputs and params).
      param_dtype: parameter dtype of every layer.
      norm_dtype, router_dtype: dtype of the norm layers / the MoE router (None: ``dtype``).
      logits_dtype: the model casts its logits to this (None: leave them as computed).
      softmax_f32: linen only: Flax's attention with its softmax in f32 (logits cast up,
        probabilities cast back to ``dtype`` for PV), as autocast does.
      outlier_scale: None (default), or d_model finite positive numbers that multiply the
        outputs of ``ln_1`` and ``ln_2`` channel-wise (a constant, not a parameter; cast to
        the norm output's dtype): outlier features in what the blocks' GEMMs see
        (``studies.lib.regimes.OutlierFeatures``).
    """

    vocab_size: int = 256
    d_model: int = 64
    num_heads: int = 4
    num_layers: int = 2
    d_ff: int = 128
    max_len: int = 64
    num_experts: int = 0
    norm: Literal["rmsnorm", "layernorm"] = "rmsnorm"
    final_norm: Literal["rmsnorm", "layernorm"] = "layernorm"
    tie_embeddings: bool = False
    scan_layers: bool = False
    remat: bool = False
    dtype: str | None = None
    param_dtype: str = "float32"
    norm_dtype: str | None = None
    router_dtype: str | None = None
    logits_dtype: str | None = None
    softmax_f32: bool = False
    outlier_scale: tuple[float, ...] | None = None

    def __post_init__(self):
        for name in ("norm", "final_norm"):
            if getattr(self, name) not in ("rmsnorm", "layernorm"):
                raise ValueError(f"{name} must be 'rmsnorm' or 'layernorm', "
                                 f"got {getattr(self, name)!r}.")
        if self.d_model % self.num_heads:
            raise ValueError(f"d_model={self.d_model} must be divisible by "
                             f"num_heads={self.num_heads}.")
        if self.outlier_scale is not None:
            scale = tuple(float(v) for v in self.outlier_scale)
            if len(scale) != self.d_model or not all(math.isfinite(v) and v > 0
                                                     for v in scale):
                raise ValueError(f"outlier_scale must be None or d_model={self.d_model} finite "
                                 f"numbers > 0, got {len(scale)} values.")
            object.__setattr__(self, "outlier_scale", scale)  # hashable, plain floats


def random_tokens(key: jax.Array, batch: int, seq_len: int, vocab_size: int = 256) -> jax.Array:
    """Uniform random byte tokens, int32 ``[batch, seq_len]``."""
    return jax.random.randint(key, (batch, seq_len), 0, vocab_size, dtype=jnp.int32)


def lm_loss(logits: jax.Array, tokens: jax.Array) -> jax.Array:
    """Next-token cross entropy (mean over positions), computed in the logits' dtype.

    ``logits[:, t]`` predicts ``tokens[:, t + 1]``.
    """
    logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
    target = tokens[:, 1:]
    nll = -jnp.take_along_axis(logp, target[..., None], axis=-1)[..., 0]
    return jnp.mean(nll)


def _switch_aux_loss(probs: jax.Array, index: jax.Array, num_experts: int) -> jax.Array:
    """Switch Transformer load-balancing loss, E * sum_e f_e * P_e (Fedus et al. 2021, eq. 4)."""
    p32 = probs.astype(jnp.float32).reshape(-1, num_experts)
    frac = jnp.mean(jax.nn.one_hot(index.reshape(-1), num_experts, dtype=jnp.float32), axis=0)
    return num_experts * jnp.sum(frac * jnp.mean(p32, axis=0))


def _top1_combine(logits: jax.Array, num_experts: int):
    probs = jax.nn.softmax(logits, axis=-1)
    index = jnp.argmax(probs, axis=-1)
    gate = jnp.max(probs, axis=-1)
    combine = jax.nn.one_hot(index, num_experts, dtype=probs.dtype) * gate[..., None]
    return probs, index, combine


# ------------------------------------------------------------------------------------- linen


class Mlp(nn.Module):
    """GELU MLP: ``Dense_0 .. Dense_{n-1}`` with GELU between them."""

    features: Sequence[int]
    dtype: Dtype | None = None
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        for i, f in enumerate(self.features):
            x = nn.Dense(f, dtype=self.dtype, param_dtype=self.param_dtype)(x)
            if i < len(self.features) - 1:
                x = nn.gelu(x)
        return x


class MlpBlock(nn.Module):
    """Transformer MLP: ``Dense_0`` (d_ff) -> GELU -> ``Dense_1`` (back to the input width)."""

    d_ff: int
    dtype: Dtype | None = None
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        h = nn.gelu(nn.Dense(self.d_ff, dtype=self.dtype, param_dtype=self.param_dtype)(x))
        return nn.Dense(x.shape[-1], dtype=self.dtype, param_dtype=self.param_dtype)(h)


class MoeBlock(nn.Module):
    """Top-1 mixture of experts with a ``router`` Dense and expert weights ``w_in``/``w_out``.

    Sows ``router_input``, ``router_logits``, ``expert_index`` and the Switch ``aux_loss``
    into ``"intermediates"`` (a no-op unless that collection is mutable).
    """

    num_experts: int
    d_ff: int
    dtype: Dtype | None = None
    param_dtype: Dtype = jnp.float32
    router_dtype: Dtype | None = None

    @nn.compact
    def __call__(self, x):
        d, e = x.shape[-1], self.num_experts
        x_router = x
        logits = nn.Dense(e, use_bias=False, dtype=self.router_dtype,
                          param_dtype=self.param_dtype, name="router")(x)
        probs, index, combine = _top1_combine(logits, e)
        init = nn.initializers.lecun_normal(batch_axis=(0,))
        w_in = self.param("w_in", init, (e, d, self.d_ff), self.param_dtype)
        w_out = self.param("w_out", init, (e, self.d_ff, d), self.param_dtype)
        x, w_in, w_out = nn.dtypes.promote_dtype(x, w_in, w_out, dtype=self.dtype)
        h = nn.gelu(jnp.einsum("...d,edf->...ef", x, w_in))
        y = jnp.einsum("...ef,efd->...ed", h, w_out)
        out = jnp.einsum("...e,...ed->...d", combine.astype(y.dtype), y)
        self.sow("intermediates", "router_input", x_router)
        self.sow("intermediates", "router_logits", logits)
        self.sow("intermediates", "expert_index", index)
        self.sow("intermediates", "aux_loss", _switch_aux_loss(probs, index, e))
        return out


def _linen_norm(kind: str, cfg: TransformerConfig, name: str) -> nn.Module:
    cls = nn.RMSNorm if kind == "rmsnorm" else nn.LayerNorm
    dtype = _dt(cfg.norm_dtype) if cfg.norm_dtype else _dt(cfg.dtype)
    return cls(dtype=dtype, param_dtype=_dt(cfg.param_dtype), name=name)


def _outlier_channels(y: jax.Array, cfg: TransformerConfig) -> jax.Array:
    """``y * outlier_scale`` over the last axis (``TransformerConfig.outlier_scale``)."""
    if cfg.outlier_scale is None:
        return y
    scale = jnp.asarray(cfg.outlier_scale, dtype=y.dtype)
    return y * scale.reshape((1,) * (y.ndim - 1) + scale.shape)


def _qk_einsum():
    return lambda subs, q, k: jnp.einsum(subs, q, k)


def _pv_einsum():
    return lambda subs, p, v: jnp.einsum(subs, p.astype(v.dtype), v)


class Block(nn.Module):
    """Pre-LN block: ``x + attn(ln_1(x))``, then ``x + MlpBlock_0/MoeBlock_0(ln_2(x))``."""

    cfg: TransformerConfig

    @nn.compact
    def __call__(self, x, mask):
        return self._forward(x, mask)

    def _forward(self, x, mask):
        cfg = self.cfg
        dt, pdt = _dt(cfg.dtype), _dt(cfg.param_dtype)
        extra = {}
        if cfg.softmax_f32:
            extra = dict(force_fp32_for_softmax=True, qk_attn_weights_einsum_cls=_qk_einsum,
                         attn_weights_value_einsum_cls=_pv_einsum)
        y = _outlier_channels(_linen_norm(cfg.norm, cfg, "ln_1")(x), cfg)
        y = nn.MultiHeadDotProductAttention(num_heads=cfg.num_heads, dtype=dt, param_dtype=pdt,
                                            name="attn", **extra)(y, mask=mask)
        x = x + y
        y = _outlier_channels(_linen_norm(cfg.norm, cfg, "ln_2")(x), cfg)
        if cfg.num_experts:
            y = MoeBlock(cfg.num_experts, cfg.d_ff, dtype=dt, param_dtype=pdt,
                         router_dtype=_dt(cfg.router_dtype) or dt)(y)
        else:
            y = MlpBlock(cfg.d_ff, dtype=dt, param_dtype=pdt)(y)
        return x + y


class _ScanBlock(Block):
    """``Block`` with the (carry, x) -> (carry, y) signature ``nn.scan`` needs."""

    @nn.compact
    def __call__(self, x, mask):
        return self._forward(x, mask), None


class TransformerLM(nn.Module):
    """Byte-level decoder-only pre-LN transformer (linen). Call on int tokens ``[B, T]``."""

    cfg: TransformerConfig

    @nn.compact
    def __call__(self, tokens):
        cfg = self.cfg
        dt, pdt = _dt(cfg.dtype), _dt(cfg.param_dtype)
        t = tokens.shape[-1]
        if t > cfg.max_len:
            raise ValueError(f"sequence length {t} exceeds max_len={cfg.max_len}.")
        embed = nn.Embed(cfg.vocab_size, cfg.d_model, dtype=dt, param_dtype=pdt, name="embed")
        pos = nn.Embed(cfg.max_len, cfg.d_model, dtype=dt, param_dtype=pdt, name="pos_embed")
        x = embed(tokens) + pos(jnp.arange(t))[None]
        mask = nn.make_causal_mask(tokens)
        if cfg.scan_layers:
            body = nn.remat(_ScanBlock) if cfg.remat else _ScanBlock
            stack = nn.scan(body, variable_axes={"params": 0}, split_rngs={"params": True},
                            in_axes=nn.broadcast, length=cfg.num_layers)
            x, _ = stack(cfg, name="blocks")(x, mask)
        else:
            block = nn.remat(Block) if cfg.remat else Block
            for i in range(cfg.num_layers):
                x = block(cfg, name=f"Block_{i}")(x, mask)
        x = _linen_norm(cfg.final_norm, cfg, "ln_f")(x)
        if cfg.tie_embeddings:
            logits = embed.attend(x)
        else:
            logits = nn.Dense(cfg.vocab_size, dtype=dt, param_dtype=pdt, name="head")(x)
        if cfg.logits_dtype is not None:
            logits = logits.astype(cfg.logits_dtype)
        return logits


# --------------------------------------------------------------------------------------- NNX


class NnxMlp(nnx.Module):
    """GELU MLP (NNX): ``layers/0 .. layers/{n-1}``."""

    def __init__(self, in_features: int, features: Sequence[int], *, dtype: Dtype | None = None,
                 param_dtype: Dtype = jnp.float32, rngs: nnx.Rngs):
        dims = [in_features, *features]
        self.layers = nnx.List([
            nnx.Linear(a, b, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
            for a, b in itertools.pairwise(dims)])

    def __call__(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = nnx.gelu(x)
        return x


class NnxMlpBlock(nnx.Module):
    """Transformer MLP (NNX): ``linear1`` -> GELU -> ``linear2``."""

    def __init__(self, d_model: int, d_ff: int, *, dtype: Dtype | None = None,
                 param_dtype: Dtype = jnp.float32, rngs: nnx.Rngs):
        self.linear1 = nnx.Linear(d_model, d_ff, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.linear2 = nnx.Linear(d_ff, d_model, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

    def __call__(self, x):
        return self.linear2(nnx.gelu(self.linear1(x)))


class NnxMoeBlock(nnx.Module):
    """Top-1 mixture of experts (NNX) with ``router`` and expert Params ``w_in``/``w_out``.

    With ``sow=True`` it sows ``router_logits``, ``expert_index`` and ``aux_loss`` as
    ``nnx.Intermediate``; collect them with ``nnx.capture(model, nnx.Intermediate)(x)``.
    """

    def __init__(self, d_model: int, d_ff: int, num_experts: int, *, dtype: Dtype | None = None,
                 param_dtype: Dtype = jnp.float32, router_dtype: Dtype | None = None,
                 sow: bool = False, rngs: nnx.Rngs):
        self.num_experts = num_experts
        self.dtype = dtype
        self.sow_router = sow
        self.router = nnx.Linear(d_model, num_experts, use_bias=False, dtype=router_dtype,
                                 param_dtype=param_dtype, rngs=rngs)
        init = nnx.initializers.lecun_normal(batch_axis=(0,))
        self.w_in = nnx.Param(init(rngs.params(), (num_experts, d_model, d_ff), param_dtype))
        self.w_out = nnx.Param(init(rngs.params(), (num_experts, d_ff, d_model), param_dtype))

    def __call__(self, x):
        e = self.num_experts
        logits = self.router(x)
        probs, index, combine = _top1_combine(logits, e)
        x, w_in, w_out = nnx.nn.dtypes.promote_dtype((x, self.w_in[...], self.w_out[...]),
                                                     dtype=self.dtype)
        h = nnx.gelu(jnp.einsum("...d,edf->...ef", x, w_in))
        y = jnp.einsum("...ef,efd->...ed", h, w_out)
        out = jnp.einsum("...e,...ed->...d", combine.astype(y.dtype), y)
        if self.sow_router:
            self.sow(nnx.Intermediate, "router_logits", logits)
            self.sow(nnx.Intermediate, "expert_index", index)
            self.sow(nnx.Intermediate, "aux_loss", _switch_aux_loss(probs, index, e))
        return out


def _nnx_norm(kind: str, cfg: TransformerConfig, rngs: nnx.Rngs):
    cls = nnx.RMSNorm if kind == "rmsnorm" else nnx.LayerNorm
    dtype = _dt(cfg.norm_dtype) if cfg.norm_dtype else _dt(cfg.dtype)
    return cls(cfg.d_model, dtype=dtype, param_dtype=_dt(cfg.param_dtype), rngs=rngs)


class NnxBlock(nnx.Module):
    """Pre-LN block (NNX): ``ln_1``, ``attn``, ``ln_2``, then ``mlp`` or ``moe``."""

    def __init__(self, cfg: TransformerConfig, *, rngs: nnx.Rngs):
        dt, pdt = _dt(cfg.dtype), _dt(cfg.param_dtype)
        self.cfg = cfg
        self.ln_1 = _nnx_norm(cfg.norm, cfg, rngs)
        self.attn = nnx.MultiHeadAttention(cfg.num_heads, cfg.d_model, decode=False, dtype=dt,
                                           param_dtype=pdt, rngs=rngs)
        self.ln_2 = _nnx_norm(cfg.norm, cfg, rngs)
        if cfg.num_experts:
            self.moe = NnxMoeBlock(cfg.d_model, cfg.d_ff, cfg.num_experts, dtype=dt,
                                   param_dtype=pdt, router_dtype=_dt(cfg.router_dtype) or dt,
                                   rngs=rngs)
        else:
            self.mlp = NnxMlpBlock(cfg.d_model, cfg.d_ff, dtype=dt, param_dtype=pdt, rngs=rngs)

    def __call__(self, x, mask):
        cfg = self.cfg
        x = x + self.attn(_outlier_channels(self.ln_1(x), cfg), mask=mask)
        ffn = self.moe if hasattr(self, "moe") else self.mlp
        return x + ffn(_outlier_channels(self.ln_2(x), cfg))


class NnxTransformerLM(nnx.Module):
    """Byte-level decoder-only pre-LN transformer (NNX). Call on int tokens ``[B, T]``."""

    def __init__(self, cfg: TransformerConfig, *, rngs: nnx.Rngs):
        if cfg.scan_layers or cfg.remat:
            raise ValueError("scan_layers and remat are linen options; NNX users write "
                             "nnx.scan / nnx.remat in their own model code.")
        dt, pdt = _dt(cfg.dtype), _dt(cfg.param_dtype)
        self.cfg = cfg
        self.embed = nnx.Embed(cfg.vocab_size, cfg.d_model, dtype=dt, param_dtype=pdt, rngs=rngs)
        self.pos_embed = nnx.Embed(cfg.max_len, cfg.d_model, dtype=dt, param_dtype=pdt,
                                   rngs=rngs)
        self.blocks = nnx.List([NnxBlock(cfg, rngs=rngs) for _ in range(cfg.num_layers)])
        self.ln_f = _nnx_norm(cfg.final_norm, cfg, rngs)
        if not cfg.tie_embeddings:
            self.head = nnx.Linear(cfg.d_model, cfg.vocab_size, dtype=dt, param_dtype=pdt,
                                   rngs=rngs)

    def __call__(self, tokens):
        cfg = self.cfg
        t = tokens.shape[-1]
        if t > cfg.max_len:
            raise ValueError(f"sequence length {t} exceeds max_len={cfg.max_len}.")
        x = self.embed(tokens) + self.pos_embed(jnp.arange(t))[None]
        mask = nnx.make_causal_mask(tokens)
        for block in self.blocks:
            x = block(x, mask)
        x = self.ln_f(x)
        logits = self.embed.attend(x) if cfg.tie_embeddings else self.head(x)
        if cfg.logits_dtype is not None:
            logits = logits.astype(cfg.logits_dtype)
        return logits


def count_params(tree: Any) -> int:
    """Number of scalar parameters in a pytree (or an NNX module's ``nnx.Param`` state)."""
    if isinstance(tree, nnx.Module):
        tree = nnx.state(tree, nnx.Param)
    return int(sum(np.prod(x.shape) for x in jax.tree.leaves(tree)))
