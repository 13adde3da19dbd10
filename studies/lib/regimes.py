"""Regimes: small, honest models of the conditions under which precision matters at scale.

A tiny model trained for a few hundred steps is far from the conditions of LLM training
in which the literature finds precision effects: its updates are large next to its weights,
its loss is averaged over a few hundred tokens, its activations have no outlier channels and
its tokens' gradients are alike. Each regime here reproduces ONE such condition, with
magnitudes taken from published measurements, as

* a frozen dataclass (hashable, a static argument; ``describe()`` for results files);
* a pure function that applies it to something a training step has (a learning rate, a
  loss multiplier, the model config's per-channel scale, per-token loss weights);
* a function that MEASURES the quantity the regime claims, so a study reports the condition
  it actually ran under rather than the one it intended.

No regime is tuned to make an effect appear: the defaults are the literature's magnitudes,
and each docstring says what the literature leads one to expect, so that a study can say
so with its numbers when the expected effect does not appear at this scale.

=======================  ===================================  ==============================
regime                   applies to                           measured by
=======================  ===================================  ==============================
``LateTraining``         the learning rate (``lr``)           ``update_ratio``,
                                                              ``stalled_fraction``
``TokensPerUpdate``      a loss multiplier (``loss_weight``)  ``underflow``
``OutlierFeatures``      ``TransformerConfig.outlier_scale``  ``channel_amax_ratio``
                         (``apply``)
``TokenGradOutliers``    per-token loss weights               ``token_norm_ratio``
                         (``loss_weights``)
``FP4Training``          ``TransformerConfig.num_layers``     ``grad_noise_ratio``,
                         (``apply``); FP4 setups keep their   ``fmtkit.fp4.
                         last block in BF16                   quantization_stats``
=======================  ===================================  ==============================

``REGIMES`` maps the names used on command lines ("late-training", "tokens-per-update",
"outlier-features", "token-grad-outliers", "fp4-training") to the default instances;
``get_regime(name)``.

References (cited by the regimes):
  [Brown20] Brown et al., "Language Models are Few-Shot Learners" (GPT-3), 2020: Table 2.1
    (peak learning rates 6e-4 for 125M down to 0.6e-4 for 175B; batch 0.5M to 3.2M tokens),
    App. B (cosine decay to 10% of the peak).
  [Touvron23] Touvron et al., "LLaMA: Open and Efficient Foundation Language Models", 2023:
    sec. 2.2 (AdamW, cosine schedule to 10% of the peak, peak 3e-4 / 1.5e-4, batch 4M
    tokens).
  [Radford18] Radford et al., "Improving Language Understanding by Generative
    Pre-Training" (GPT), 2018: sec. 4.1 (weights initialized from N(0, 0.02)).
  [Kingma15] Kingma & Ba, "Adam", ICLR 2015: sec. 2.1 (|update| is about the step size).
  [Micikevicius18] Micikevicius et al., "Mixed Precision Training", ICLR 2018: sec. 3.1
    (fp32 master weights: updates too small next to the weights vanish in fp16),
    sec. 3.2 (activation gradients below fp16's range; loss scaling).
  [Zamirai20] Zamirai et al., "Revisiting BFloat16 Training", 2020 (arXiv 2010.06192):
    pure bf16 training loses small updates; stochastic rounding or Kahan summation recover
    fp32 accuracy.
  [DeepSeek24] DeepSeek-AI, "DeepSeek-V3 Technical Report", 2024 (arXiv 2412.19437):
    sec. 3.3 (fine-grained 1x128 / 128x128 FP8 scaling against outliers; batch up to
    15360 sequences of 4K tokens), App. B.2 (128x128 blocks on activation gradients made
    a 16B MoE diverge; "token-correlated outliers").
  [Dettmers22] Dettmers et al., "LLM.int8()", NeurIPS 2022: sec. 4 (systematic outlier
    features in a few hidden dimensions of the inputs of the linear layers, in most tokens
    and layers, from ~6.7B parameters).
  [Xiao23] Xiao et al., "SmoothQuant", ICML 2023: sec. 3 (activation outlier channels
    about 100x larger than most activations, persistent across tokens).
  [Sun24] Sun et al., "Massive Activations in Large Language Models", 2024 (arXiv
    2402.17762): a few activations up to 100,000x larger than the others.
  [Wei22] Wei et al., "Outlier Suppression", NeurIPS 2022: LayerNorm's scale amplifies the
    outlier channels.
  [Xi23] Xi et al., "Training Transformers with 4-bit Integers", NeurIPS 2023: activation
    gradients are structurally sparse (a few token rows dominate).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from studies.lib.models import TransformerConfig

__all__ = [
    "FP16_MIN_SUBNORMAL",
    "READERS",
    "REGIMES",
    "FP4Training",
    "LateTraining",
    "OutlierFeatures",
    "TokenGradOutliers",
    "TokensPerUpdate",
    "channel_amax",
    "channel_amax_ratio",
    "get_regime",
    "grad_noise_ratio",
    "stalled_fraction",
    "token_norm_ratio",
    "token_norms",
    "underflow",
    "update_ratio",
    "weighted_lm_loss",
]

F32 = jnp.float32

FP16_MIN_SUBNORMAL = 2.0**-24
"""fp16's smallest positive subnormal (IEEE 754 binary16: 2^(1-15-10)); round-to-nearest
sends |g| <= 2^-25 to zero."""


def _positive(value: Any, name: str, *, integer: bool = False) -> None:
    ok = (not isinstance(value, bool)
          and isinstance(value, int if integer else (int, float))
          and math.isfinite(value) and value > 0)
    if not ok:
        kind = "an int >= 1" if integer else "a finite number > 0"
        raise ValueError(f"{name} must be {kind}, got {value!r}.")


class _Regime:
    name: ClassVar[str]

    def describe(self) -> dict[str, Any]:
        """JSON-ready: the regime's name and fields."""
        return {"regime": self.name, **dataclasses.asdict(self)}


_NOT_WEIGHTS = ("bias", "scale")
"""Flax's names for biases and norm scales (linen and NNX)."""


def _key_name(k: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def _is_weight(path: Any, x: Any) -> bool:
    """A weight matrix: ndim >= 2 and not named ``bias``/``scale`` (multi-head attention's
    biases are 2-D and start at 0)."""
    return jnp.ndim(x) >= 2 and not (path and _key_name(path[-1]) in _NOT_WEIGHTS)


def _matrices(tree: Any) -> list[jax.Array]:
    """The weight matrices (``_is_weight``): kernels, embeddings, stacked experts."""
    return [x for p, x in jax.tree_util.tree_leaves_with_path(tree) if _is_weight(p, x)]


def _norm(leaves: list[Any]) -> jax.Array:
    return jnp.sqrt(sum((jnp.sum(jnp.square(jnp.asarray(x).astype(F32))) for x in leaves),
                        jnp.zeros([], F32)))


# ---------------------------------------------------------------------------------------------
# Late training: update-to-weight ratios of the end of an LLM schedule


@dataclasses.dataclass(frozen=True)
class LateTraining(_Regime):
    """Per-step update-to-weight ratios as at the end of an LLM cosine schedule.

    Magnitudes: Adam's per-element update is about the learning rate [Kingma15]; LLM peak
    learning rates are 0.6e-4 to 6e-4 [Brown20] or 1.5e-4 to 3e-4 [Touvron23], decayed to
    10% of the peak by the end of a cosine schedule [Brown20, Touvron23]; weight matrices
    start at std 0.02 [Radford18]. So the end-of-schedule ratio |update| / |weight| is about
    (0.6e-5 .. 6e-5) / 0.02 = 3e-4 .. 3e-3 per step, or 1e-4 .. 1e-3 once the weights have
    grown; the default 3e-4 is the geometric middle of 1e-4 .. 1e-3. The tiny model's own
    ratio at lr 3e-3 is about 3e-3 / 0.09 = 3e-2, a hundred times larger.

    Applies to: the learning rate. ``lr(params, direction)`` is the step size that makes
    ||lr * direction|| / ||params|| equal ``update_to_weight`` over the weight matrices
    (leaves with ndim >= 2 not named ``bias`` or ``scale``: biases start at 0 and norm
    scales at 1, so a ratio over them means little), for the optimizer's update direction
    at unit learning rate (Adam's m_hat / (sqrt(v_hat) + eps)). A study trains normally,
    then continues at that constant learning rate: the end of a schedule.

    Measured by: ``update_ratio(old, new)`` (the ratio actually taken) and
    ``stalled_fraction(params, updates, dtype)`` (the share of elements whose update rounds
    away in ``dtype``).

    Expected (literature): bf16 has 8 significant bits, so an update smaller than half a
    unit in the last place, 2^-9 .. 2^-8 = 0.2% .. 0.4% of the weight, is rounded away:
    at ratios of 1e-4 .. 1e-3 most elements of pure-bf16 parameters stop moving, while fp32
    master weights [Micikevicius18], stochastic rounding and Kahan summation [Zamirai20]
    keep them moving (the 1.0 + 1e-3 example of ``fmtkit study master-weights``, inside
    training). The loss cost at
    this scale depends on how long the late phase runs; the study reports it either way.

    Measured (the "tiny" model of ``studies.training.TrainConfig()``, its first Adam step):
    lr = 2.7e-5 gives the 3e-4 ratio; there 92% of the bf16 parameter elements stall,
    against 0.08% at the model's own lr of 3e-3 (ratio 3.3e-2). Adam's direction shrinks
    as training proceeds (|m_hat / sqrt(v_hat)| < 1), so calibrate ``lr`` at the step where
    the late phase starts, not at step 0.
    """

    name: ClassVar[str] = "late-training"
    update_to_weight: float = 3e-4

    def __post_init__(self):
        _positive(self.update_to_weight, "update_to_weight")

    def lr(self, params: Any, direction: Any) -> jax.Array:
        """The learning rate giving ``update_to_weight`` for ``direction`` (f32 scalar):
        ``update_to_weight * ||W|| / ||direction||`` over the weight matrices.

        Args:
          params: the parameters (any pytree).
          direction: the optimizer's update at unit learning rate, same structure (its
            sign does not matter).
        """
        w, d = _norm(_matrices(params)), _norm(_matrices(direction))
        return jnp.float32(self.update_to_weight) * w / d


def update_ratio(old: Any, new: Any) -> dict[str, jax.Array]:
    """The update-to-weight ratio of one step, over the weight matrices (leaves with
    ndim >= 2 not named ``bias`` or ``scale``, Flax's names for biases and norm scales).

    Returns:
      ``{"global": ||new - old|| / ||old||, "median": median over matrices of
      ||new_i - old_i|| / ||old_i||, "min": ..., "max": ...}``, f32 scalars (differences
      taken in f32).
    """
    pairs = [(o, n) for (p, o), n in zip(jax.tree_util.tree_leaves_with_path(old),
                                         jax.tree.leaves(new)) if _is_weight(p, o)]
    if not pairs:
        raise ValueError("update_ratio needs at least one weight matrix (ndim >= 2, not "
                         "named bias or scale).")
    deltas = [n.astype(F32) - o.astype(F32) for o, n in pairs]
    per = jnp.stack([_norm([d]) / _norm([o]) for d, (o, _) in zip(deltas, pairs)])
    return {"global": _norm(deltas) / _norm([o for o, _ in pairs]),
            "median": jnp.median(per), "min": jnp.min(per), "max": jnp.max(per)}


def stalled_fraction(params: Any, updates: Any, dtype: Any = jnp.bfloat16) -> jax.Array:
    """The share of nonzero updates lost when ``params + updates`` is stored in ``dtype``.

    An element stalls when round_dtype(w + u) == w for u != 0, with w the parameter already
    in ``dtype`` and the sum taken in f32 (round-to-nearest-even, as a plain cast).

    Args:
      params: the parameters (cast to ``dtype`` first).
      updates: the updates, same structure.
      dtype: the storage dtype (bfloat16 by default).

    Returns:
      f32 scalar in [0, 1] (0 when every update is 0).
    """
    lost = jnp.zeros([], F32)
    nonzero = jnp.zeros([], F32)
    for w, u in zip(jax.tree.leaves(params), jax.tree.leaves(updates)):
        w_lp = jnp.asarray(w).astype(dtype)
        u32 = jnp.asarray(u).astype(F32)
        moved = (w_lp.astype(F32) + u32).astype(dtype) != w_lp
        nz = u32 != 0
        lost = lost + jnp.sum(nz & ~moved, dtype=F32)
        nonzero = nonzero + jnp.sum(nz, dtype=F32)
    return jnp.where(nonzero > 0, lost / jnp.maximum(nonzero, 1.0), 0.0)


# ---------------------------------------------------------------------------------------------
# Tokens per update: the loss normalized over an LLM-sized global batch


@dataclasses.dataclass(frozen=True)
class TokensPerUpdate(_Regime):
    """The loss normalized over an LLM-sized global batch, as when micro-batches accumulate.

    With gradient accumulation and data parallelism, each micro-batch contributes
    sum_t loss_t / N_global to the loss whose gradient is taken, so the gradient one
    micro-batch produces (before accumulation and before any unscaling) is its mean-loss
    gradient times micro_tokens / N_global.

    Magnitudes: N_global = 2^22 = 4.2M tokens by default: 4M tokens per batch for LLaMA
    [Touvron23], 3.2M for GPT-3 175B [Brown20]; DeepSeek-V3 reaches 15360 x 4K = 63M
    [DeepSeek24].

    Applies to: a loss multiplier. ``loss_weight(micro_tokens)`` = micro_tokens /
    ``global_tokens``, with micro_tokens the tokens whose loss the step averages (the
    trainer's batch x predicted positions); multiply the mean loss by it. The tiny model's
    micro-batch (~500 tokens) is 8-30x smaller than an LLM's per-device micro-batch (4K to
    16K tokens), which makes the multiplier smaller than at scale, while its per-element
    gradients are larger (few parameters share the signal); the two partly offset, so the
    regime reports the measured flush share instead of claiming a match.

    Measured by: ``underflow(grads)``: the share of nonzero gradient elements under fp16's
    smallest subnormal 2^-24 and the share that a cast to fp16 flushes to zero.

    Expected (literature): gradients under 2^-24 vanish in fp16 [Micikevicius18, sec. 3.2],
    so fp16 without loss scaling loses them and trains worse; dynamic loss scaling shifts
    them back into range and matches bf16; bf16 (smallest subnormal 2^-133) is unaffected.

    Measured (the "tiny" model of ``studies.training.TrainConfig()``, batch 8 x 64, step 0):
    the multiplier is 504 / 2^22 = 1.2e-4; 11.8% of the nonzero parameter-gradient elements
    fall under 2^-24 (6.0% flush to zero in a cast to fp16) against 0.07% without the
    regime, and all of them are under fp16's smallest normal 2^-14 (median |g| 3.2e-7).
    """

    name: ClassVar[str] = "tokens-per-update"
    global_tokens: int = 2**22

    def __post_init__(self):
        _positive(self.global_tokens, "global_tokens", integer=True)

    def loss_weight(self, micro_tokens: int) -> float:
        """micro_tokens / global_tokens: the factor on a micro-batch's mean loss.

        Raises:
          ValueError: ``micro_tokens`` not an int in 1..global_tokens.
        """
        _positive(micro_tokens, "micro_tokens", integer=True)
        if micro_tokens > self.global_tokens:
            raise ValueError(f"micro_tokens={micro_tokens} exceeds "
                             f"global_tokens={self.global_tokens}.")
        return micro_tokens / self.global_tokens


def underflow(grads: Any) -> dict[str, jax.Array]:
    """fp16's view of gradients (in their own dtype, e.g. f32).

    Returns:
      f32 scalars over all nonzero elements: ``below_min_subnormal`` (|g| < 2^-24),
      ``flushed`` (nonzero, but zero after a round-to-nearest cast to fp16: |g| <= 2^-25),
      ``subnormal`` (|g| < 2^-14, fp16's smallest normal: fewer than 11 significant bits),
      and ``median_abs`` (median |g| of the nonzero elements; NaN if there are none).
    """
    flat = jnp.concatenate([jnp.ravel(jnp.asarray(g)).astype(F32)
                            for g in jax.tree.leaves(grads)])
    a = jnp.abs(flat)
    nz = a > 0
    n = jnp.maximum(jnp.sum(nz, dtype=F32), 1.0)
    flushed = nz & (flat.astype(jnp.float16) == 0)
    return {
        "below_min_subnormal": jnp.sum(nz & (a < F32(FP16_MIN_SUBNORMAL)), dtype=F32) / n,
        "flushed": jnp.sum(flushed, dtype=F32) / n,
        "subnormal": jnp.sum(nz & (a < F32(2.0**-14)), dtype=F32) / n,
        "median_abs": jnp.nanmedian(jnp.where(nz, a, jnp.nan)),
    }


# ---------------------------------------------------------------------------------------------
# Outlier features in the residual stream the GEMMs read


@dataclasses.dataclass(frozen=True)
class OutlierFeatures(_Regime):
    """A few activation channels far larger than the rest, in what the blocks' GEMMs read.

    Magnitudes: LLMs carry systematic outlier features in a handful of hidden dimensions
    (about 6 of 4096 in a 6.7B model, in most tokens and layers) in the inputs of their
    linear layers [Dettmers22]; such channels are about 100x the typical activation
    [Xiao23], and the largest "massive" activations reach 10^4 to 10^5x [Sun24]. The
    usual range is 100x to 10^4x; ``fmtkit study fp8-outliers`` uses 1e2, 1e4 and 3e4. The default
    1e4 is the top of that range (a tenth of [Sun24]'s largest); ``channels=1`` because
    6/4096 of a d_model of 128..512 rounds to one channel.

    Applies to: ``TransformerConfig.outlier_scale`` (``apply(cfg)``): the outputs of every
    block's ``ln_1`` and ``ln_2`` are multiplied by ``channel_scale(d_model)`` (1 except
    ``channels`` channels, chosen by ``seed``, at ``magnitude``), the way a large norm scale
    makes outliers in LLMs [Wei22]. It changes the model (as outliers change LLMs): compare
    setups within the regime (fp32 in the regime is the reference).

    Held at zero: the rows of the kernels that read the scaled channels (``reader_mask``:
    attention query/key/value, the MLP's first Dense, the MoE router and experts' ``w_in``)
    start at 0 and get no gradient, so the outlier channels carry nothing to the GEMMs'
    outputs: in exact arithmetic the model computes what it computes without the regime,
    and only the quantizers see the outliers. Without this the 1e4x channel dominates every
    block at initialization and the model learns to route around its blocks (measured: the
    tiny model's bf16-mixed loss after 150 steps was 3.014 with free rows against 2.819
    without the regime), so the precision of the blocks' GEMMs hardly reaches the loss.
    LLMs show the same pairing: the weights that read an outlier channel are small
    [Xiao23, sec. 3].

    Measured by: ``channel_amax_ratio(x)`` on a GEMM's input: the largest channel amax over
    the median channel amax.

    Expected (literature): per-tensor FP8 scaling lets the outlier set the scale, pushing
    the other channels down into E4M3's subnormals; fine-grained scaling confines it to its
    tile [DeepSeek24]. The size of the effect depends on the magnitude and on the tile
    length along K. Relative error of the normal channels of a 512 x 128 Gaussian with one
    outlier channel, E4M3, per-tensor / per-row (measured with ml_dtypes): 2.66% / 2.65%
    at 1e3, 5.07% / 2.76% at 1e4, 15.1% / 4.3% at 3e4. A 1 x 128 tile equals a row when
    d_model = 128; only wider models or MX's 1 x 32 blocks separate the outlier channel
    from the others along K.
    """

    name: ClassVar[str] = "outlier-features"
    magnitude: float = 1e4
    channels: int = 1
    seed: int = 0

    def __post_init__(self):
        _positive(self.magnitude, "magnitude")
        _positive(self.channels, "channels", integer=True)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"seed must be an int >= 0, got {self.seed!r}.")

    def outlier_channels(self, d_model: int) -> np.ndarray:
        """The outlier channels' indices (sorted): ``channels`` distinct indices drawn by
        ``numpy.random.default_rng(seed).choice(d_model, channels, replace=False)``."""
        _positive(d_model, "d_model", integer=True)
        if self.channels > d_model:
            raise ValueError(f"channels={self.channels} exceeds d_model={d_model}.")
        rng = np.random.default_rng(self.seed)
        return np.sort(rng.choice(d_model, size=self.channels, replace=False))

    def channel_scale(self, d_model: int) -> np.ndarray:
        """float32 [d_model]: 1, and ``magnitude`` at ``outlier_channels(d_model)``."""
        s = np.ones(d_model, np.float32)
        s[self.outlier_channels(d_model)] = self.magnitude
        return s

    def apply(self, cfg: TransformerConfig) -> TransformerConfig:
        """``cfg`` with ``outlier_scale = channel_scale(cfg.d_model)``."""
        return dataclasses.replace(
            cfg, outlier_scale=tuple(float(v) for v in self.channel_scale(cfg.d_model)))

    def reader_mask(self, params: Any, d_model: int) -> Any:
        """Like ``params``: float32 ones, with zeros at the outlier channels' rows of the
        kernels that read the scaled norm outputs (``READERS``: their d_model axis is the
        first, or the second for the experts' stacked ``w_in``). Multiply the initial
        parameters and every gradient by it."""
        rows = self.outlier_channels(d_model)

        def mask(path, x):
            m = np.ones(x.shape, np.float32)
            key = "/".join(_key_name(k) for k in path)
            if re.search(READERS, key):
                axis = 1 if key.endswith("w_in") else 0
                if m.shape[axis] != d_model:
                    raise ValueError(f"{key}: axis {axis} has {m.shape[axis]} rows, not "
                                     f"d_model={d_model}.")
                np.moveaxis(m, axis, 0)[rows] = 0.0
            return m

        return jax.tree_util.tree_map_with_path(mask, params)


READERS = (r"attn/(query|key|value)/kernel$|MlpBlock_0/Dense_0/kernel$|"
           r"MoeBlock_0/(router/kernel|w_in)$")
"""Parameter paths (``studies.lib.models.TransformerLM``) of the kernels that read ``ln_1`` /
``ln_2``'s outputs, where ``OutlierFeatures`` scales channels."""


def channel_amax(x: jax.typing.ArrayLike) -> jax.Array:
    """Per-channel amax (max |x| over every axis but the last), f32 [channels]."""
    a = jnp.abs(jnp.asarray(x).astype(F32))
    return jnp.max(a.reshape(-1, a.shape[-1]), axis=0)


def channel_amax_ratio(x: jax.typing.ArrayLike) -> jax.Array:
    """max over channels of the channel amax / median channel amax (f32 scalar): ~1-10 for
    Gaussian activations, ``magnitude`` times that with an outlier channel."""
    amax = channel_amax(x)
    return jnp.max(amax) / jnp.median(amax)


# ---------------------------------------------------------------------------------------------
# Token-wise gradient outliers


@dataclasses.dataclass(frozen=True)
class TokenGradOutliers(_Regime):
    """A few tokens whose gradients are far above the rest (rare, surprising tokens).

    Source: DeepSeek-V3 found that 128 x 128 blocks on activation gradients made a 16B MoE
    diverge after ~300B tokens, and attributed it to token-correlated gradient outliers
    [DeepSeek24, App. B.2]; activation gradients are dominated by a few token rows [Xi23].
    Neither gives a ratio. The default 100x follows from the loss itself: the gradient of
    a token's cross entropy at the logits is softmax - onehot, of norm ~1 for a surprising
    token and ~0.01 for a confidently predicted one (p = 0.99), a ratio of ~100 that a
    trained LM shows and a tiny model early in training does not. ``fraction`` = 1/256
    puts one outlier in about every other 128-token block, so 128 x 128 blocks along the
    tokens see them and 1 x 128 tiles (one token each) do not.

    Applies to: per-token loss weights (``loss_weights(key, shape)``): ``k = max(1,
    round(fraction * n))`` positions chosen uniformly without replacement get weight
    ``magnitude``, the rest 1, all divided by their mean (mean weight 1: the loss keeps its
    scale). Use with ``weighted_lm_loss``; a new key per step moves the outliers.

    Measured by: ``token_norm_ratio(g)`` on an activation gradient: the largest per-token
    L2 norm over the median one.

    Expected (literature): 128 x 128 activation-gradient blocks are worse than 1 x 128
    tiles under such outliers [DeepSeek24]; at the tiny scale the sign of the loss gap is
    what a study can check.
    """

    name: ClassVar[str] = "token-grad-outliers"
    fraction: float = 1.0 / 256.0
    magnitude: float = 100.0

    def __post_init__(self):
        _positive(self.magnitude, "magnitude")
        _positive(self.fraction, "fraction")
        if self.fraction > 1:
            raise ValueError(f"fraction must be in (0, 1], got {self.fraction!r}.")

    def count(self, n: int) -> int:
        """Outlier positions among ``n`` tokens: max(1, round(fraction * n))."""
        return max(1, round(self.fraction * n))

    def loss_weights(self, key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
        """f32 weights of ``shape`` (e.g. [batch, seq_len - 1], one per predicted token).

        Returns:
          ``w / mean(w)`` with w = ``magnitude`` at ``count(n)`` random positions (from
          ``key``) and 1 elsewhere: outlier / normal weight = ``magnitude`` exactly.
        """
        n = math.prod(shape)
        k = self.count(n)
        idx = jax.random.choice(key, n, (k,), replace=False)
        w = jnp.ones(n, F32).at[idx].set(F32(self.magnitude))
        return (w / jnp.mean(w)).reshape(shape)


def weighted_lm_loss(logits: jax.Array, tokens: jax.Array, weights: jax.Array) -> jax.Array:
    """Next-token cross entropy weighted per position: mean(weights * nll) in f32.

    ``logits[:, t]`` predicts ``tokens[:, t + 1]`` (as ``studies.lib.models.lm_loss``);
    ``weights`` is [batch, seq_len - 1]. With weights of mean 1 (``loss_weights``) the
    loss keeps the unweighted loss's scale; all-ones weights give ``lm_loss``.
    """
    logp = jax.nn.log_softmax(logits[:, :-1].astype(F32), axis=-1)
    nll = -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
    return jnp.mean(weights.astype(F32) * nll)


def token_norms(g: jax.typing.ArrayLike) -> jax.Array:
    """Per-token L2 norm of an activation gradient [..., features] -> f32 [...]."""
    g32 = jnp.asarray(g).astype(F32)
    return jnp.sqrt(jnp.sum(jnp.square(g32), axis=-1))


def token_norm_ratio(g: jax.typing.ArrayLike) -> jax.Array:
    """max over tokens of the per-token gradient norm / its median (f32 scalar)."""
    norms = token_norms(g).ravel()
    return jnp.max(norms) / jnp.median(norms)


# ---------------------------------------------------------------------------------------------
# FP4 training: a stack whose last blocks stay in BF16


@dataclasses.dataclass(frozen=True)
class FP4Training(_Regime):
    """A stack of blocks deep enough to keep its last ones in BF16 by position, as FP4
    training does, and the FP4 setups that ablate the NVFP4 recipe's ingredients.

    Magnitudes: the NVFP4 paper's 12B model kept the first 2 and the last 8 of its 62
    blocks in BF16 (16% of the linear layers), and advises under 15%, mostly at the end
    [NVFP4, sec. 4.1, App. A.1]. The default ``num_layers=4`` at the tiny model's width
    (d_model 128) is the shallowest stack in which one kept block (the FP4 setups'
    ``keep_last=1``) leaves most linear layers in FP4: 25% in BF16, more than the paper's
    share, and 4x the tiny model's one block of compute.

    Applies to: ``TransformerConfig.num_layers`` (``apply``; an explicit ``--num-layers``
    wins); the FP4 setups (``studies.training.setups.FP4_SETUPS``) keep their last block
    in BF16 (``fmtkit.policy.keep_blocks``), except ``nvfp4-all-layers``.

    Measured by: ``fmtkit.fp4.quantization_stats`` on each linear layer's GEMM operands
    (SQNR, share of blocks that saturate or underflow) and ``grad_noise_ratio`` (the weight
    gradient's norm over the norm of its FP4-induced error, against the BF16 gradient at the
    same parameters and batch).

    Expected (literature): vs BF16 at 8B / 1T tokens, MXFP4 ~2.5% and NVFP4 ~1.5% worse in
    loss [NVFP4, sec. 5]; from 3.43T tokens of a 12B run, removing SR, RHT or 2D weight
    blocks, or keeping only the last 4 blocks in BF16, each made the loss worse [NVFP4,
    Fig. 4]; a 1.2B model with every layer in FP4 diverged [NVFP4, App. E.2]. Training in
    FP4 stops helping once the gradient's norm falls below about sqrt(3) times its
    quantization noise [FP4AllTheWay]. These are effects of long runs at scale; at 100
    steps of a 4-block model the study reports which orderings appear and which do not.

    References: [NVFP4] NVIDIA, "Pretraining Large Language Models with NVFP4", 2025
    (arXiv 2509.25149). [FP4AllTheWay] Chmiel et al., "FP4 All the Way: Fully Quantized
    Training of LLMs", 2025 (arXiv 2505.19115), abstract.
    """

    name: ClassVar[str] = "fp4-training"
    num_layers: int = 4

    def __post_init__(self):
        _positive(self.num_layers, "num_layers", integer=True)
        if self.num_layers < 2:
            raise ValueError(f"num_layers must be >= 2 (one kept block and one in FP4), got "
                             f"{self.num_layers}.")

    def apply(self, cfg: TransformerConfig) -> TransformerConfig:
        """``cfg`` with ``num_layers`` blocks."""
        return dataclasses.replace(cfg, num_layers=self.num_layers)


def grad_noise_ratio(reference: Any, grads: Any) -> jax.Array:
    """``||reference|| / ||grads - reference||`` over the weight matrices (f32 scalar): the
    gradient's norm over the norm of its quantization noise (inf when they are equal).
    Below about sqrt(3) the noise hides the descent direction [FP4AllTheWay]."""
    pairs = [(r, g) for (p, r), g in zip(jax.tree_util.tree_leaves_with_path(reference),
                                         jax.tree.leaves(grads)) if _is_weight(p, r)]
    if not pairs:
        raise ValueError("grad_noise_ratio needs at least one weight matrix.")
    return _norm([r for r, _ in pairs]) / _norm([g.astype(F32) - r.astype(F32)
                                                 for r, g in pairs])


# ---------------------------------------------------------------------------------------------
# Registry

REGIMES: Mapping[str, _Regime] = {
    r.name: r for r in (LateTraining(), TokensPerUpdate(), OutlierFeatures(),
                        TokenGradOutliers(), FP4Training())
}
"""The regimes by command-line name, with their default (literature) magnitudes."""


def get_regime(name: str) -> _Regime:
    """The default instance of a regime by name (``REGIMES``).

    Raises:
      ValueError: unknown name (the message lists the known ones).
    """
    if name not in REGIMES:
        raise ValueError(f"unknown regime {name!r}; known: {', '.join(REGIMES)}.")
    return REGIMES[name]
