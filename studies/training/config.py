"""``TrainConfig``: what to train and for how long, validated on construction."""

from __future__ import annotations

import dataclasses
import math
from typing import Annotated, Any, Literal

import tyro

from studies.lib.models import TransformerConfig

__all__ = ["MODEL_SIZES", "REGIME_NAMES", "TrainConfig"]

REGIME_NAMES = ("none", "late-training", "tokens-per-update", "outlier-features",
                "token-grad-outliers", "fp4-training")
"""``TrainConfig.regime`` values: "none" or a name of ``studies.lib.regimes.REGIMES``."""

MODEL_SIZES: dict[str, dict[str, int]] = {
    # d_model and d_ff are multiples of 128 so that every FP8 recipe (blockwise: 1x128 /
    # 128x128 tiles; mxfp8: 32-element blocks) applies to every linear layer.
    "tiny": dict(d_model=128, num_heads=4, num_layers=1, d_ff=256),
    "small": dict(d_model=256, num_heads=4, num_layers=4, d_ff=1024),
    "base": dict(d_model=512, num_heads=8, num_layers=6, d_ff=2048),
}
"""Model size presets of ``TrainConfig.model_size`` (vocab 256, max_len = seq_len)."""


def _check_int(value: Any, name: str, *, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r}.")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}.")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """What to train and for how long (hashable; the same config gives the same run).

    Every training study nests one (``Config.train``), so these options are declared once;
    on the command line they appear without a prefix (``--steps 300 --lr 1e-3``).

    Attributes:
      model_size: "tiny" (d_model 128, 1 layer, d_ff 256), "small" (4 layers of 256) or
        "base" (6 layers of 512); ignored when ``model`` is given.
      num_layers: override the preset's number of layers (0: keep it).
      steps: optimizer steps.
      batch: sequences per step (any size: FP8 recipes zero-pad what their blocks do not
        divide).
      seq_len: bytes per sequence (the model's max_len).
      lr: peak learning rate of AdamW (b1 0.9, b2 0.95, eps 1e-8).
      warmup: linear warmup steps from 0 (capped at steps // 2), then cosine decay to lr / 10
        (``optax.warmup_cosine_decay_schedule``).
      weight_decay: AdamW's decoupled weight decay (on every parameter).
      clip_norm: clip the (unscaled) gradients to this global norm; 0 disables.
      seed: seeds the initial parameters, the batch order and stochastic rounding.
      data: path of a UTF-8 text file to train on; None: the embedded corpus
        (``studies.lib.corpus.default_corpus``, known entropy rate).
      corpus_bytes: size of the embedded corpus.
      checkpoint_every: save the full train state every this many steps (and at the end)
        when the run has a checkpoint folder; 0: never.
      data_parallel: shard each batch over this many local devices (a ``Mesh`` with axis
        "data", ``NamedSharding``); 1: one device. Under ``jax.distributed`` (several
        processes, ``python -m studies.app.launch``) the global device count of all processes.
      model: an explicit ``TransformerConfig`` (e.g. with ``num_experts``) instead of the
        size preset; its ``max_len`` must be >= seq_len. Not a command-line option.
      aux_loss_weight: weight of the Switch load-balancing loss when the model has experts.
      seeds: seeds per setup: ``seed, seed + 1, ..., seed + seeds - 1`` (each its own
        initial parameters, batches and stochastic-rounding stream), trained together by
        one vmapped step (``studies.training.multiseed``). ``train`` runs ``seed`` only.
      regime: "none" or a regime of ``studies.lib.regimes`` applied with its default
        (literature) magnitudes: "late-training" (constant learning rate ``lr``, which
        ``studies.training.multiseed.late_training`` calibrates to an update-to-weight ratio
        of 3e-4 from fp32-pretrained parameters), "tokens-per-update" (the gradient-carrying
        loss multiplied by batch * (seq_len - 1) / 2^22), "outlier-features" (one
        residual-stream channel 1e4x after every LayerNorm) or "token-grad-outliers"
        (1/256 of the tokens weighted 100x in the loss, new positions every step).
      heldout_windows: windows of ``seq_len`` bytes of held-out text evaluated at the end
        (``--data stdlib`` only; 0: none).
    """

    model_size: Literal["tiny", "small", "base"] = "tiny"
    num_layers: int = 0
    steps: int = 200
    batch: int = 8
    seq_len: int = 64
    lr: float = 3e-3
    warmup: int = 20
    weight_decay: float = 0.01
    clip_norm: float = 1.0
    seed: int = 0
    data: str | None = None
    corpus_bytes: int = 1 << 20
    checkpoint_every: int = 0
    data_parallel: int = 1
    model: Annotated[TransformerConfig | None, tyro.conf.Suppress] = None
    aux_loss_weight: float = 0.01
    seeds: int = 3
    regime: Literal["none", "late-training", "tokens-per-update", "outlier-features",
                    "token-grad-outliers", "fp4-training"] = "none"
    heldout_windows: int = 64

    def __post_init__(self):
        if self.model is None and self.model_size not in MODEL_SIZES:
            raise ValueError(f"model_size must be one of {', '.join(MODEL_SIZES)}, got "
                             f"{self.model_size!r}.")
        if self.model is not None and not isinstance(self.model, TransformerConfig):
            raise TypeError(f"model must be a studies.lib.models.TransformerConfig or None, got "
                            f"{type(self.model).__name__}.")
        _check_int(self.num_layers, "num_layers", minimum=0)
        _check_int(self.steps, "steps")
        _check_int(self.batch, "batch")
        _check_int(self.seq_len, "seq_len", minimum=2)  # next-byte prediction needs 2
        _check_int(self.warmup, "warmup", minimum=0)
        _check_int(self.seed, "seed", minimum=0)
        _check_int(self.corpus_bytes, "corpus_bytes")
        _check_int(self.checkpoint_every, "checkpoint_every", minimum=0)
        _check_int(self.data_parallel, "data_parallel")
        _check_int(self.seeds, "seeds")
        _check_int(self.heldout_windows, "heldout_windows", minimum=0)
        if self.regime not in REGIME_NAMES:
            raise ValueError(f"regime must be one of {', '.join(REGIME_NAMES)}, got "
                             f"{self.regime!r}.")
        for name in ("lr", "weight_decay", "clip_norm", "aux_loss_weight"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise TypeError(f"{name} must be a finite number, got {v!r}.")
            if v < 0 or (name == "lr" and v == 0):
                raise ValueError(f"{name} must be {'> 0' if name == 'lr' else '>= 0'}, "
                                 f"got {v}.")
        if self.seed + self.seeds > 2**31:
            raise ValueError(f"seed + seeds must fit in int32, got {self.seed} + "
                             f"{self.seeds}.")
        if self.batch % self.data_parallel:
            raise ValueError(f"batch={self.batch} must be divisible by "
                             f"data_parallel={self.data_parallel}.")
        if self.model is not None and self.model.max_len < self.seq_len:
            raise ValueError(f"model.max_len={self.model.max_len} must be >= "
                             f"seq_len={self.seq_len}.")

    def model_config(self) -> TransformerConfig:
        """The ``TransformerConfig`` trained (f32 model; the policy sets the precisions)."""
        if self.model is not None:
            mcfg = self.model
        else:
            mcfg = TransformerConfig(max_len=self.seq_len, **MODEL_SIZES[self.model_size])
        if self.num_layers:
            mcfg = dataclasses.replace(mcfg, num_layers=self.num_layers)
        elif self.regime == "fp4-training":
            from studies.lib.regimes import FP4Training

            mcfg = FP4Training().apply(mcfg)
        if self.regime == "outlier-features" and mcfg.outlier_scale is None:
            # (an explicit model with its own outlier_scale keeps it: ``fmtkit ablate``'s
            # outlier group sets its magnitude and width that way)
            from studies.lib.regimes import OutlierFeatures

            mcfg = OutlierFeatures().apply(mcfg)
        return mcfg

    @property
    def seed_list(self) -> tuple[int, ...]:
        """The seeds of a multi-seed run: ``seed .. seed + seeds - 1``."""
        return tuple(range(self.seed, self.seed + self.seeds))

    def with_seed(self, seed: int) -> TrainConfig:
        """This config for one seed (``seed=seed, seeds=1``)."""
        return dataclasses.replace(self, seed=seed, seeds=1)

    @property
    def warmup_steps(self) -> int:
        """The warmup actually used: ``min(warmup, steps // 2)``."""
        return min(self.warmup, self.steps // 2)
