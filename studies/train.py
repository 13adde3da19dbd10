"""The shared LM-training library of the training studies (``ablate``, ``fp8-recipes``, ...).

A *setup* is what one row of a precision ablation means: a policy (``fmtkit.with_policy``
preset or ``Rules``), how parameters are stored and updated (plain optax updates, float32
master weights, stochastic rounding or Kahan compensation of low-precision updates) and
whether the loss is scaled. ``train`` runs one setup under one ``TrainConfig`` on the
byte-level ``studies.models.TransformerLM`` and returns its loss curve and telemetry.

API (stable; other studies build on it):

* ``TrainConfig``: frozen, hashable: model size preset ("tiny", "small", "base") or an
  explicit ``model=TransformerConfig(...)`` (e.g. MoE: ``num_experts``; the Switch aux loss
  is added with ``aux_loss_weight``); steps, batch, seq_len, lr, warmup, weight_decay,
  clip_norm, seed, data path (None: the embedded corpus), checkpoint_every, data_parallel
  (shard the batch over that many local devices: ``jax.jit`` + ``NamedSharding`` on a
  ``Mesh`` with axis "data"). ``cfg.model_config()``.
* ``Setup`` (frozen dataclass) and the registry ``SETUPS`` (name -> Setup; ``DEFAULT_SETUPS``
  is its key order); ``get_setup(name)`` (ValueError listing the valid names). Studies may
  build their own ``Setup(name, policy=Rules(...), ...)``.
* ``TrainState`` (NamedTuple pytree): params, opt_state, fp8_state, step (int32), rng
  (uint32[2]). It is everything a run needs to continue: ``train`` checkpoints it whole.
* ``make_train_step(setup, cfg) -> (init_fn, step_fn)``: no I/O. ``init_fn() -> TrainState``;
  ``step_fn(state, tokens) -> (state, metrics)`` is ``jax.jit``-compiled and traces once for
  any number of steps (nothing that changes per step is static). ``tokens``: int32
  ``[cfg.batch, cfg.seq_len]`` from ``batch_at``. Cached per (setup, config): calling it
  again returns the same compiled functions.
* ``make_optimizer(setup, cfg)``, ``build_model(setup, cfg)``, ``load_data(cfg)``,
  ``batch_at(data, cfg, step)``, ``lr_schedule(cfg)``: the pieces, for studies that need
  their own step.
* ``train(setup, cfg, progress=no_progress, run_dir=None, resume=False) -> TrainResult``.

Metrics of a step (all scalars; ``metrics`` of ``step_fn`` and the per-step lists of
``TrainResult.history``):

* ``loss``: next-token cross entropy (nats/byte) of the batch before the update, in f32
  (the logits are cast to f32 first), *unscaled*.
* ``loss_scale``: the scale the loss was multiplied by for this step's gradients (1 without
  loss scaling).
* ``skipped``: 1 when the optimizer skipped the step (``dynamic_loss_scale`` found a
  non-finite gradient), else 0.
* ``grad_flush``: fraction of the nonzero gradient values that flush to zero in the setup's
  gradient format ``setup.grad_format``: with ``g`` every element of the gradient tree the
  optimizer receives (the gradient of the *scaled* loss when the loss is scaled, as stored,
  usually f32), pooled over all parameters,

      grad_flush = #(g != 0 and fmtkit.cast(g, grad_format) == 0) / #(g != 0)

  (0 when no gradient value is nonzero). For "fp16" this is the share of gradient values
  that fp16 cannot represent at all (below half its smallest subnormal, 2^-25): what loss
  scaling exists to rescue. Values already flushed inside the backward pass (the policy
  rounds cotangents through its gradient dtype at module boundaries) are zeros, so they are
  not counted: the metric is a lower bound of the total loss of gradient information.
* ``grad_norm``: global L2 norm of the unscaled gradients (f32; inf/NaN on overflow).
* ``update_frac``: fraction of parameter elements whose stored value changed in this step
  (1.0 means every parameter moved; pure-bf16 loses small updates and scores lower).

For FP8 setups ``grad_flush`` is measured in bf16 (the gradient dtype of the fp8-* presets);
the FP8 quantization inside the scaled dots is not part of it (``fmtkit.telemetry`` measures
that). On a step the loss scale skips, the FP8 delayed-scaling amax histories are left
unchanged (the observed amaxes are inf/NaN then).

Determinism: batch ``k`` is drawn from ``numpy.random.default_rng([cfg.seed, k])`` (start
offsets into the corpus), the parameters from ``jax.random.PRNGKey(cfg.seed)`` (in f32, then
rounded to each setup's parameter dtype, so all setups start from the same point), stochastic
rounding from seeds in the optimizer state. A run resumed from a checkpoint at step k sees the
same batches and ends bit-identical to an uninterrupted one (tested).

Example:
  >>> cfg = TrainConfig(steps=20)
  >>> result = train(get_setup("bf16-mixed"), cfg)          # doctest: +SKIP
  >>> result.final_loss, result.compile_seconds, result.step_ms  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

import fmtkit
from fmtkit import optim
from fmtkit.casting import cast
from fmtkit.fp8 import FP8Recipe
from fmtkit.fp8 import update_state as fp8_update_state
from fmtkit.memory import ledger
from fmtkit.policy import (
    Rules,
    as_rules,  # what with_policy accepts, as Rules
)
from studies import corpus
from studies._common import Progress, StudyError, no_progress
from studies.models import TransformerConfig, TransformerLM, lm_loss

__all__ = [
    "DEFAULT_SETUPS",
    "METRIC_KEYS",
    "MODEL_SIZES",
    "SETUPS",
    "Setup",
    "TrainConfig",
    "TrainResult",
    "TrainState",
    "batch_at",
    "build_model",
    "get_setup",
    "load_data",
    "lr_schedule",
    "make_optimizer",
    "make_train_step",
    "train",
]

F32 = jnp.float32

MODEL_SIZES: dict[str, dict[str, int]] = {
    # d_model and d_ff are multiples of 128 so that every FP8 recipe (blockwise: 1x128 /
    # 128x128 tiles; mxfp8: 32-element blocks) applies to every linear layer.
    "tiny": dict(d_model=128, num_heads=4, num_layers=1, d_ff=256),
    "small": dict(d_model=256, num_heads=4, num_layers=4, d_ff=1024),
    "base": dict(d_model=512, num_heads=8, num_layers=6, d_ff=2048),
}
"""Model size presets of ``TrainConfig.model_size`` (vocab 256, max_len = seq_len)."""


# ---------------------------------------------------------------------------------------------
# Configuration


def _pos_int(value: Any, name: str, *, zero_ok: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r}.")
    if value < (0 if zero_ok else 1):
        raise ValueError(f"{name} must be >= {0 if zero_ok else 1}, got {value}.")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """What to train and for how long (hashable; the same config gives the same run).

    Attributes:
      model_size: "tiny" (d_model 128, 1 layer, d_ff 256), "small" or "base"
        (``MODEL_SIZES``); ignored when ``model`` is given.
      steps: optimizer steps.
      batch: sequences per step.
      seq_len: bytes per sequence (the model's max_len).
      lr: peak learning rate of AdamW (b1 0.9, b2 0.95, eps 1e-8).
      warmup: linear warmup steps (capped at steps // 2), then cosine decay to lr / 10.
      weight_decay: AdamW's decoupled weight decay (on every parameter).
      clip_norm: clip the (unscaled) gradients to this global norm; 0 disables.
      seed: seeds the initial parameters, the batch order and stochastic rounding.
      data: path of a UTF-8 text file to train on; None: the embedded corpus
        (``studies.corpus.default_corpus``, known entropy rate).
      corpus_bytes: size of the embedded corpus.
      checkpoint_every: save the full train state every this many steps (and at the end)
        when ``train`` gets a ``run_dir``; 0: never.
      data_parallel: shard each batch over this many local devices (a ``Mesh`` with axis
        "data", ``NamedSharding``); 1: one device.
      model: an explicit ``TransformerConfig`` (e.g. with ``num_experts``) instead of the
        size preset; its ``max_len`` must be >= seq_len.
      aux_loss_weight: weight of the Switch load-balancing loss when the model has experts.
    """

    model_size: Literal["tiny", "small", "base"] = "tiny"
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
    model: TransformerConfig | None = None
    aux_loss_weight: float = 0.01

    def __post_init__(self):
        if self.model is None and self.model_size not in MODEL_SIZES:
            raise ValueError(f"model_size must be one of {', '.join(MODEL_SIZES)}, got "
                             f"{self.model_size!r}.")
        if self.model is not None and not isinstance(self.model, TransformerConfig):
            raise TypeError(f"model must be a studies.models.TransformerConfig or None, got "
                            f"{type(self.model).__name__}.")
        _pos_int(self.steps, "steps")
        _pos_int(self.batch, "batch")
        _pos_int(self.seq_len, "seq_len")
        if self.seq_len < 2:
            raise ValueError(f"seq_len must be >= 2 (next-byte prediction), got {self.seq_len}.")
        _pos_int(self.warmup, "warmup", zero_ok=True)
        _pos_int(self.seed, "seed", zero_ok=True)
        _pos_int(self.corpus_bytes, "corpus_bytes")
        _pos_int(self.checkpoint_every, "checkpoint_every", zero_ok=True)
        _pos_int(self.data_parallel, "data_parallel")
        for name in ("lr", "weight_decay", "clip_norm", "aux_loss_weight"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise TypeError(f"{name} must be a finite number, got {v!r}.")
            if v < 0 or (name == "lr" and v == 0):
                raise ValueError(f"{name} must be {'> 0' if name == 'lr' else '>= 0'}, "
                                 f"got {v}.")
        if self.seed >= 2**31:
            raise ValueError(f"seed must fit in int32, got {self.seed}.")
        if self.batch % self.data_parallel:
            raise ValueError(f"batch={self.batch} must be divisible by "
                             f"data_parallel={self.data_parallel}.")
        if self.model is not None and self.model.max_len < self.seq_len:
            raise ValueError(f"model.max_len={self.model.max_len} must be >= "
                             f"seq_len={self.seq_len}.")

    def model_config(self) -> TransformerConfig:
        """The ``TransformerConfig`` trained (f32 model; the policy sets the precisions)."""
        if self.model is not None:
            return self.model
        return TransformerConfig(max_len=self.seq_len, **MODEL_SIZES[self.model_size])

    @property
    def warmup_steps(self) -> int:
        """The warmup actually used: ``min(warmup, steps // 2)``."""
        return min(self.warmup, self.steps // 2)


# ---------------------------------------------------------------------------------------------
# Setups


@dataclasses.dataclass(frozen=True)
class Setup:
    """One training setup: a precision policy plus parameter storage/update and loss scaling.

    Attributes:
      name: short name (a row of the ablation table).
      policy: a ``fmtkit.with_policy`` preset name (``fmtkit.list_presets()``), a policy
        string or ``Rules``. The policy's ``param_dtype`` is the parameter storage.
      update: how updates reach the parameters: "plain" (``optax.apply_updates``: the sum is
        rounded to the parameter dtype, so small updates to bf16 weights vanish),
        "master" (``fmtkit.optim.master_weights``: f32 masters, params = round(master)),
        "stochastic" (``fmtkit.optim.stochastic_round_updates``) or "kahan"
        (``fmtkit.optim.kahan_updates``).
      loss_scaling: "none", "dynamic" (``fmtkit.optim.dynamic_loss_scale``, PyTorch
        GradScaler defaults unless overridden below) or "static".
      init_scale: initial (dynamic) or constant (static) loss scale.
      growth_interval: finite steps before the dynamic scale grows (PyTorch: 2000).
      grad_format: the format whose flush-to-zero of gradient values ``grad_flush`` reports
        (the policy's gradient dtype: "float16" for fp16 policies).
      may_diverge: a non-finite loss ends this setup's run as "diverged" instead of raising
        ``StudyError``.
      description: one line for tables and --help.
    """

    name: str
    policy: str | Rules
    update: Literal["plain", "master", "stochastic", "kahan"] = "plain"
    loss_scaling: Literal["none", "dynamic", "static"] = "none"
    init_scale: float = 2.0**16
    growth_interval: int = 2000
    grad_format: str = "float32"
    may_diverge: bool = False
    description: str = ""

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"name must be a non-empty str, got {self.name!r}.")
        if self.update not in ("plain", "master", "stochastic", "kahan"):
            raise ValueError(f"update must be 'plain', 'master', 'stochastic' or 'kahan', got "
                             f"{self.update!r}.")
        if self.loss_scaling not in ("none", "dynamic", "static"):
            raise ValueError(f"loss_scaling must be 'none', 'dynamic' or 'static', got "
                             f"{self.loss_scaling!r}.")
        fmtkit.get_format(self.grad_format)  # ValueError listing the formats
        as_rules(self.policy)  # ValueError on an unknown preset or a bad policy string

    def rules(self) -> Rules:
        """The policy as ``Rules``."""
        return as_rules(self.policy)

    def fp8_recipes(self) -> tuple[FP8Recipe, ...]:
        """The FP8 recipes the policy's rules use (empty for none)."""
        rules = self.rules()
        pols = [p for _, p in rules.rules] + [rules.default]
        return tuple(dict.fromkeys(p.fp8 for p in pols if getattr(p, "fp8", None) is not None))


def _setups() -> dict[str, Setup]:
    s = [
        Setup("fp32", "fp32", grad_format="float32",
              description="everything f32 (the reference), AdamW"),
        Setup("bf16-mixed", "bf16-mixed", grad_format="bfloat16",
              description="f32 params, bf16 compute/activations/gradients, AdamW"),
        Setup("pure-bf16", "pure-bf16", grad_format="bfloat16",
              description="bf16 params and moments, AdamW updates rounded to bf16 "
                          "(small updates vanish)"),
        Setup("pure-bf16-sr", "pure-bf16", update="stochastic", grad_format="bfloat16",
              description="bf16 params, updates stochastically rounded to bf16"),
        Setup("pure-bf16-kahan", "pure-bf16", update="kahan", grad_format="bfloat16",
              description="bf16 params, Kahan-compensated updates (bf16 buffer)"),
        Setup("bf16-master", "pure-bf16", update="master", grad_format="bfloat16",
              description="bf16 params and compute, f32 master weights and moments"),
        Setup("fp16", "fp16-mixed", grad_format="float16", may_diverge=True,
              description="f32 params, fp16 compute/gradients, no loss scaling"),
        Setup("fp16-dynamic", "fp16-mixed", loss_scaling="dynamic", grad_format="float16",
              description="f32 params, fp16 compute, dynamic loss scaling (from 2^16)"),
    ]
    for recipe in ("current", "delayed", "rowwise", "blockwise", "mxfp8"):
        s.append(Setup(f"fp8-{recipe}", f"fp8-{recipe}", grad_format="bfloat16",
                       description=f"bf16-mixed + FP8 {recipe} recipe on the linear layers"))
    return {x.name: x for x in s}


SETUPS: dict[str, Setup] = _setups()
"""The registered setups (what ``fmtkit ablate --policies`` accepts), in table order."""

DEFAULT_SETUPS: tuple[str, ...] = tuple(SETUPS)
"""All registered setups: the default of ``fmtkit ablate``."""


def get_setup(name: str | Setup) -> Setup:
    """The registered setup called ``name`` (a ``Setup`` is returned unchanged).

    Raises:
      ValueError: unknown name (the message lists the valid ones).
    """
    if isinstance(name, Setup):
        return name
    if not isinstance(name, str) or name not in SETUPS:
        raise ValueError(f"unknown setup (policy) {name!r}; valid: {', '.join(SETUPS)}.")
    return SETUPS[name]


# ---------------------------------------------------------------------------------------------
# Data


def load_data(cfg: TrainConfig) -> np.ndarray:
    """The training bytes as ``uint8[n]``: ``cfg.data`` (a UTF-8 file) or the embedded corpus.

    Raises:
      FileNotFoundError, IsADirectoryError, ValueError: a missing, folder, empty or non-UTF-8
        ``cfg.data`` (``studies.corpus.load_text``); ValueError: fewer than seq_len bytes.
    """
    raw = (corpus.default_corpus(cfg.corpus_bytes) if cfg.data is None
           else corpus.load_text(cfg.data))
    data = np.frombuffer(raw, dtype=np.uint8)
    if data.size < cfg.seq_len:
        where = "the corpus" if cfg.data is None else f"--data {cfg.data!r}"
        raise ValueError(f"{where} has {data.size} bytes, fewer than seq_len={cfg.seq_len}.")
    return data


def batch_at(data: np.ndarray, cfg: TrainConfig, step: int) -> np.ndarray:
    """The tokens of step ``step``: int32 ``[batch, seq_len]``, a pure function of
    ``(cfg.seed, step)`` (random start offsets from ``numpy.random.default_rng([seed, step])``).

    Example:
      >>> cfg = TrainConfig(batch=2, seq_len=4)
      >>> d = np.arange(100, dtype=np.uint8)
      >>> bool((batch_at(d, cfg, 7) == batch_at(d, cfg, 7)).all())
      True
    """
    rng = np.random.default_rng([cfg.seed, int(step)])
    starts = rng.integers(0, data.size - cfg.seq_len + 1, size=cfg.batch)
    return data[starts[:, None] + np.arange(cfg.seq_len)].astype(np.int32)


# ---------------------------------------------------------------------------------------------
# Model, optimizer, state


class TrainState(NamedTuple):
    """Everything a run needs to continue (a pytree; ``train`` checkpoints all of it).

    Attributes:
      params: the model parameters in their stored dtypes.
      opt_state: the optimizer state (moments, loss scale, master weights, ...).
      fp8_state: the Flax "fp8_state" collection (delayed-scaling amax histories); ``{}``
        when the policy has no delayed recipe.
      step: int32, steps done = the index of the next batch.
      rng: uint32[2], a PRNG key advanced every step (reserved for dropout and the like).
    """

    params: Any
    opt_state: Any
    fp8_state: Any
    step: jax.Array
    rng: jax.Array


def build_model(setup: Setup, cfg: TrainConfig) -> Any:
    """``fmtkit.with_policy(TransformerLM(cfg.model_config()), setup.policy)``."""
    return fmtkit.with_policy(TransformerLM(cfg.model_config()), setup.rules())


def lr_schedule(cfg: TrainConfig) -> Callable[[jax.Array], jax.Array]:
    """Linear warmup over ``cfg.warmup_steps`` to ``cfg.lr``, then cosine decay to lr / 10 at
    ``cfg.steps``: ``lr(t) = lr * (t + 1) / w`` for t < w, else
    ``lr * (0.1 + 0.45 * (1 + cos(pi * (t - w) / (steps - w))))`` (f32)."""
    w, n, peak = cfg.warmup_steps, cfg.steps, cfg.lr

    def schedule(count):
        t = jnp.asarray(count).astype(F32)
        warm = jnp.float32(peak) * (t + 1.0) / jnp.float32(max(w, 1))
        frac = jnp.clip((t - jnp.float32(w)) / jnp.float32(max(n - w, 1)), 0.0, 1.0)
        decay = jnp.float32(peak) * (0.1 + 0.45 * (1.0 + jnp.cos(jnp.float32(math.pi) * frac)))
        return jnp.where(t < jnp.float32(w), warm, decay)

    return schedule


def make_optimizer(setup: Setup, cfg: TrainConfig) -> optax.GradientTransformation:
    """The optimizer of a setup: clip + ``fmtkit.optim.adamw`` (moments in the parameters'
    dtype), wrapped per ``setup.update`` and ``setup.loss_scaling``:
    ``dynamic_loss_scale(master_weights(chain(clip, adamw)))`` at the most."""
    parts = []
    if cfg.clip_norm > 0:
        parts.append(optax.clip_by_global_norm(cfg.clip_norm))
    parts.append(optim.adamw(lr_schedule(cfg), b1=0.9, b2=0.95, eps=1e-8,
                             weight_decay=cfg.weight_decay))
    opt: optax.GradientTransformation = optax.chain(*parts)
    if setup.update == "master":
        opt = optim.master_weights(opt)
    elif setup.update == "stochastic":
        opt = optim.stochastic_round_updates(opt, seed=cfg.seed)
    elif setup.update == "kahan":
        opt = optim.kahan_updates(opt)
    if setup.loss_scaling == "dynamic":
        opt = optim.dynamic_loss_scale(opt, init_scale=setup.init_scale,
                                       growth_interval=setup.growth_interval)
    elif setup.loss_scaling == "static":
        opt = optim.static_loss_scale(opt, scale=setup.init_scale)
    return opt


def _check_fp8_shapes(setup: Setup, cfg: TrainConfig) -> None:
    """A clear error before tracing when a block-scaled FP8 recipe cannot tile the model."""
    tiles = [t for r in setup.fp8_recipes() for t in (r.x_tile, r.w_tile, r.grad_tile)]
    need = 128 if any("128" in t for t in tiles) else (32 if "mx32" in tiles else 1)
    if need == 1:
        return
    m = cfg.model_config()
    names = ", ".join(r.name for r in setup.fp8_recipes())
    for name, v in (("batch * seq_len", cfg.batch * cfg.seq_len), ("d_model", m.d_model),
                    ("d_ff", m.d_ff)):
        if v % need:
            raise ValueError(f"setup {setup.name!r} uses the FP8 recipe {names}, whose blocks "
                             f"need {name} divisible by {need}; got {v}.")


def _flush_counts(grads: Any, fmt: str) -> tuple[jax.Array, jax.Array]:
    """(#nonzero, #nonzero that flush to zero in ``fmt``) over all gradient leaves (f32)."""
    nonzero = jnp.zeros([], F32)
    flushed = jnp.zeros([], F32)
    for g in jax.tree.leaves(grads):
        nz = g != 0
        nonzero = nonzero + jnp.sum(nz, dtype=F32)
        flushed = flushed + jnp.sum(nz & (cast(g, fmt) == 0), dtype=F32)
    return nonzero, flushed


def _global_norm(tree: Any) -> jax.Array:
    return jnp.sqrt(sum((jnp.sum(jnp.square(x.astype(F32))) for x in jax.tree.leaves(tree)),
                        jnp.zeros([], F32)))


def make_train_step(setup: Setup | str, cfg: TrainConfig
                    ) -> tuple[Callable[[], TrainState],
                               Callable[[TrainState, jax.Array], tuple[TrainState, dict]]]:
    """The init and (jitted) step functions of one setup; no I/O.

    One step, with ``S`` the loss scale (1 without scaling)::

        logits = model.apply({"params": p, "fp8_state": s}, tokens)     (policy applied)
        loss = lm_loss(f32(logits), tokens) [+ aux_loss_weight * aux for MoE]
        g, obs = grad(S * loss) w.r.t. (p, s)
        updates, opt_state = opt.update(g, opt_state, p)           (make_optimizer)
        p = optax.apply_updates(p, updates)
        s = fmtkit.fp8.update_state(s, obs)     (delayed recipe only; not on a skipped step)

    The functions are cached per (step-relevant fields of the setup, config): a second call
    with the same arguments returns the same, already compiled, functions.

    Args:
      setup: a ``Setup`` or a registered name.
      cfg: the training configuration.

    Returns:
      ``(init_fn, step_fn)``: ``init_fn() -> TrainState`` (step 0; the parameters are the
      f32 initialisation of ``TransformerLM`` with ``PRNGKey(cfg.seed)``, rounded to the
      policy's parameter dtypes); ``step_fn(state, tokens) -> (state, metrics)``, jitted,
      metrics as in the module docstring.

    Raises:
      ValueError: unknown setup; batch/model sizes an FP8 recipe of the setup cannot tile;
        ``cfg.data_parallel`` larger than the number of local devices.
    """
    setup = get_setup(setup)
    _check_fp8_shapes(setup, cfg)
    if cfg.data_parallel > 1:
        _mesh(cfg.data_parallel)
    # Name, description, may_diverge, data path and checkpointing do not change the step.
    return _build_step(
        dataclasses.replace(setup, name="step", description="", may_diverge=False),
        dataclasses.replace(cfg, data=None, checkpoint_every=0))


@functools.lru_cache(maxsize=8)
def _reference_params(mcfg: TransformerConfig, seed: int, batch: int, seq_len: int) -> Any:
    """The f32 initial parameters every setup starts from (compiled once per process)."""
    dummy = jnp.zeros((batch, seq_len), jnp.int32)
    return jax.jit(TransformerLM(mcfg).init)(jax.random.PRNGKey(seed), dummy)["params"]


@functools.lru_cache(maxsize=32)
def _build_step(setup: Setup, cfg: TrainConfig):
    mcfg = cfg.model_config()
    model = build_model(setup, cfg)
    opt = make_optimizer(setup, cfg)
    scaled = setup.loss_scaling != "none"
    moe = mcfg.num_experts > 0
    dummy = jnp.zeros((cfg.batch, cfg.seq_len), jnp.int32)
    key = jax.random.PRNGKey(cfg.seed)
    shapes = jax.eval_shape(model.init, key, dummy)
    init_fp8 = jax.jit(lambda k: model.init(k, dummy)["fp8_state"]) \
        if "fp8_state" in shapes else None

    def init_fn() -> TrainState:
        # Same starting point for every setup: f32 init, rounded to the policy's dtypes.
        ref = _reference_params(mcfg, cfg.seed, cfg.batch, cfg.seq_len)
        params = jax.tree.map(lambda x, s: x.astype(s.dtype), ref, shapes["params"])
        fp8_state = init_fp8(key) if init_fp8 is not None else {}
        with jax.numpy_dtype_promotion("standard"):
            opt_state = opt.init(params)
        state = TrainState(params, opt_state, fp8_state, jnp.zeros([], jnp.int32),
                           jax.random.fold_in(key, 1))
        # Committed to its device(s), as a restored checkpoint is: the compiled step's cache
        # key includes commitment, so a resumed run reuses the compiled step.
        if cfg.data_parallel > 1:
            sharding = jax.sharding.NamedSharding(_mesh(cfg.data_parallel),
                                                  jax.sharding.PartitionSpec())
        else:
            sharding = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        return jax.device_put(state, sharding)

    def loss_fn(params, fp8_state, tokens, scale):
        variables = {"params": params}
        if fp8_state:
            variables["fp8_state"] = fp8_state
        if moe:  # MoeBlock sows the Switch load-balancing loss into "intermediates"
            logits, inter = model.apply(variables, tokens, mutable=["intermediates"])
            aux = sum((jnp.sum(x.astype(F32)) for path, x in
                       jax.tree_util.tree_leaves_with_path(inter)
                       if "aux_loss" in jax.tree_util.keystr(path)), jnp.zeros([], F32))
        else:
            logits, aux = model.apply(variables, tokens), None
        loss = lm_loss(logits.astype(F32), tokens)
        total = loss if aux is None else loss + jnp.float32(cfg.aux_loss_weight) * aux
        return total * scale, loss

    def step_fn(state: TrainState, tokens: jax.Array) -> tuple[TrainState, dict]:
        scale = optim.loss_scale(state.opt_state) if scaled else jnp.ones([], F32)
        (_, loss), (grads, obs) = jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True)(
            state.params, state.fp8_state, tokens, scale)
        nonzero, flushed = _flush_counts(grads, setup.grad_format)
        grad_norm = _global_norm(grads) / scale
        with jax.numpy_dtype_promotion("standard"):  # optax mixes f32 schedules and bf16
            updates, opt_state = opt.update(grads, state.opt_state, state.params)
            params = optax.apply_updates(state.params, updates)
        fp8_state = state.fp8_state
        if fp8_state:
            fp8_state = fp8_update_state(fp8_state, obs)
            if scaled:  # a skipped step's amaxes are inf/NaN: keep them out of the history
                finite = optax.tree_utils.tree_get(opt_state, "skipped_steps") == \
                    optax.tree_utils.tree_get(state.opt_state, "skipped_steps")
                fp8_state = jax.tree.map(lambda n, o: jnp.where(finite, n, o), fp8_state,
                                         state.fp8_state)
        changed = sum((jnp.sum(a != b, dtype=F32) for a, b in zip(
            jax.tree.leaves(params), jax.tree.leaves(state.params))), jnp.zeros([], F32))
        n_params = sum(x.size for x in jax.tree.leaves(params))
        skipped_before = optax.tree_utils.tree_get(state.opt_state, "skipped_steps", None)
        skipped = (jnp.zeros([], jnp.int32) if skipped_before is None else
                   optax.tree_utils.tree_get(opt_state, "skipped_steps") - skipped_before)
        metrics = {
            "loss": loss,
            "loss_scale": scale,
            "skipped": skipped.astype(jnp.int32),
            "grad_flush": jnp.where(nonzero > 0, flushed / jnp.maximum(nonzero, 1.0), 0.0),
            "grad_norm": grad_norm,
            "update_frac": changed / jnp.float32(n_params),
        }
        new = TrainState(params, opt_state, fp8_state, state.step + 1,
                         jax.random.split(state.rng)[0])
        return new, metrics

    if cfg.data_parallel > 1:
        mesh = _mesh(cfg.data_parallel)
        repl = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        data_sh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
        step_jit = jax.jit(step_fn, in_shardings=(repl, data_sh), out_shardings=(repl, repl))
    else:
        step_jit = jax.jit(step_fn)
    return init_fn, step_jit


def _mesh(n: int) -> jax.sharding.Mesh:
    devices = jax.local_devices()
    if n > len(devices):
        raise ValueError(f"data_parallel={n} needs {n} local devices; this process has "
                         f"{len(devices)} ({devices[0].platform}). On CPU, set XLA_FLAGS="
                         f"--xla_force_host_platform_device_count={n} before starting.")
    return jax.sharding.Mesh(np.array(devices[:n]), ("data",))


# ---------------------------------------------------------------------------------------------
# The loop


@dataclasses.dataclass
class TrainResult:
    """What ``train`` returns.

    Attributes:
      setup: the setup's name.
      history: per-step metric lists (keys as in the module docstring), steps 0..n-1.
      steps_done: steps run (fewer than cfg.steps when the run diverged).
      diverged_at: the step whose loss was non-finite (only for ``may_diverge`` setups).
      compile_seconds: trace + compile time of the step function (~0 when this process
        compiled the same step before: ``make_train_step`` caches).
      step_ms: median wall time of a step after the first, metrics fetched (ms).
      first_step_seconds: the first call of the compiled step.
      bytes_per_param: ``fmtkit.memory.ledger(params, optimizer).bytes_per_param``.
      memory: that ledger as a dict.
      resumed_from: the checkpoint step a resumed run started from (None: from scratch).
      state: the final ``TrainState``.
    """

    setup: str
    history: dict[str, list[float]]
    steps_done: int
    diverged_at: int | None
    compile_seconds: float
    step_ms: float
    first_step_seconds: float
    bytes_per_param: float
    memory: dict[str, Any]
    resumed_from: int | None
    state: TrainState

    @property
    def diverged(self) -> bool:
        return self.diverged_at is not None

    @property
    def final_loss(self) -> float:
        """Mean loss of the last ``max(1, steps_done // 10)`` steps (nan if diverged)."""
        if self.diverged or not self.history["loss"]:
            return float("nan")
        losses = self.history["loss"]
        k = max(1, len(losses) // 10)
        return float(np.mean(losses[-k:]))

    def summary(self) -> dict[str, Any]:
        """JSON-ready numbers (no state)."""
        h = self.history
        return {
            "setup": self.setup, "final_loss": self.final_loss, "steps_done": self.steps_done,
            "diverged_at": self.diverged_at,
            "skipped_steps": int(np.sum(h["skipped"])) if h["skipped"] else 0,
            "grad_flush": float(np.mean(h["grad_flush"])) if h["grad_flush"] else 0.0,
            "update_frac": float(np.mean(h["update_frac"])) if h["update_frac"] else 0.0,
            "final_loss_scale": h["loss_scale"][-1] if h["loss_scale"] else None,
            "compile_seconds": self.compile_seconds, "step_ms": self.step_ms,
            "first_step_seconds": self.first_step_seconds,
            "bytes_per_param": self.bytes_per_param, "memory": self.memory,
            "resumed_from": self.resumed_from, "history": h,
        }


METRIC_KEYS = ("loss", "loss_scale", "skipped", "grad_flush", "grad_norm", "update_frac")
"""The per-step metrics of ``step_fn`` and ``TrainResult.history`` (module docstring)."""


def _config_record(setup: Setup, cfg: TrainConfig) -> dict[str, Any]:
    """What a checkpoint must agree with to be resumed (checkpoint_every may change)."""
    c = dataclasses.asdict(cfg)
    c.pop("checkpoint_every")
    if c["model"] is not None:
        c["model"] = dataclasses.asdict(cfg.model)
    return {"setup": repr(setup), "config": json.loads(json.dumps(c, default=str))}


def _manager(run_dir: Path):
    import orbax.checkpoint as ocp

    options = ocp.CheckpointManagerOptions(enable_async_checkpointing=False, create=True)
    return ocp.CheckpointManager(Path(run_dir).absolute() / "checkpoints", options=options)


def _save(mngr, state: TrainState, history: dict, record: dict) -> None:
    import orbax.checkpoint as ocp

    step = int(state.step)
    meta = {**record, "history": history}
    mngr.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(_to_saveable(state)), meta=ocp.args.JsonSave(meta)),
        force=True)
    mngr.wait_until_finished()


def _to_saveable(state: TrainState) -> dict[str, Any]:
    """The state's leaves as a flat dict (orbax is strict about empty nodes and ``None``;
    the tree structure comes back from ``init_fn``)."""
    return {f"{i:05d}": x for i, x in enumerate(jax.tree.leaves(state))}


def _restore(mngr, template: TrainState, record: dict) -> tuple[TrainState, dict]:
    import orbax.checkpoint as ocp

    step = mngr.latest_step()
    meta = mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    if meta.get("setup") != record["setup"] or meta.get("config") != record["config"]:
        raise ValueError(
            f"the checkpoint in {mngr.directory} was written by a different setup or config; "
            f"it has {meta.get('setup')} {meta.get('config')}, this run {record['setup']} "
            f"{record['config']}.")
    leaves, treedef = jax.tree.flatten(template)
    abstract = {f"{i:05d}": jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
                for i, x in enumerate(leaves)}
    out = mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract)))
    restored = out["state"]
    state = jax.tree.unflatten(treedef, [restored[f"{i:05d}"] for i in range(len(leaves))])
    return state, meta["history"]


def train(setup: Setup | str, cfg: TrainConfig, progress: Progress = no_progress,
          run_dir: str | Path | None = None, resume: bool = False, *,
          data: np.ndarray | None = None) -> TrainResult:
    """Trains one setup for ``cfg.steps`` steps and returns its curve and telemetry.

    Compiles the step once (timed separately: ``compile_seconds``), then runs the steps,
    fetching each step's metrics (which waits for the device: ``step_ms`` is a real step).
    A non-finite loss raises ``StudyError``, unless ``setup.may_diverge``: then the run stops
    there and is marked diverged (``diverged_at``). With ``run_dir`` and
    ``cfg.checkpoint_every > 0`` the full ``TrainState`` (params, optimizer state with loss
    scale and master weights, fp8 state, step, rng) and the metric history are saved with
    orbax under ``run_dir/checkpoints/<step>/`` every ``checkpoint_every`` steps and at the
    end; ``resume=True`` continues from the latest one (from scratch if there is none), so
    that the final state and the loss curve equal an uninterrupted run's bit for bit.

    Args:
      setup: a ``Setup`` or a registered name.
      cfg: the training configuration.
      progress: progress-bar factory (``studies._common.Progress``).
      run_dir: folder of this run's checkpoints (None: no checkpoints).
      resume: continue from the latest checkpoint in ``run_dir``.
      data: the training bytes (``load_data(cfg)`` if None; pass it to share one corpus).

    Returns:
      A ``TrainResult``.

    Raises:
      StudyError: non-finite loss in a setup not expected to diverge.
      ValueError: ``resume`` without ``run_dir``; a checkpoint of another setup/config.
      OSError, ValueError: a bad ``cfg.data`` (``load_data``).
    """
    setup = get_setup(setup)
    if resume and run_dir is None:
        raise ValueError("resume=True needs run_dir (the folder holding the checkpoints).")
    if data is None:
        data = load_data(cfg)
    init_fn, step_fn = make_train_step(setup, cfg)
    state = init_fn()
    history: dict[str, list[float]] = {k: [] for k in METRIC_KEYS}
    record = _config_record(setup, cfg)
    mngr = None
    resumed_from = None
    if run_dir is not None and (cfg.checkpoint_every > 0 or resume):
        mngr = _manager(Path(run_dir))
        if resume and mngr.latest_step() is not None:
            state, history = _restore(mngr, state, record)
            resumed_from = int(state.step)

    def put(tokens: np.ndarray) -> jax.Array:
        if cfg.data_parallel > 1:
            sh = jax.sharding.NamedSharding(_mesh(cfg.data_parallel),
                                            jax.sharding.PartitionSpec("data"))
            return jax.device_put(tokens, sh)
        return jnp.asarray(tokens)

    start = int(state.step)
    compiled, compile_seconds = None, 0.0
    if start < cfg.steps:  # (a resumed run that had finished has nothing left to compile)
        t0 = time.perf_counter()
        compiled = step_fn.lower(state, put(batch_at(data, cfg, start))).compile()
        compile_seconds = time.perf_counter() - t0

    times: list[float] = []
    diverged_at = None
    first_step = float("nan")
    for i in progress(range(start, cfg.steps), total=cfg.steps - start, desc=setup.name):
        tokens = put(batch_at(data, cfg, i))
        t = time.perf_counter()
        state, metrics = compiled(state, tokens)
        metrics = jax.device_get(metrics)
        dt = time.perf_counter() - t
        if i == start:
            first_step = dt
        else:
            times.append(dt)
        for k in METRIC_KEYS:
            history[k].append(float(metrics[k]))
        loss = float(metrics["loss"])
        if not math.isfinite(loss):
            if setup.may_diverge:
                diverged_at = i
                break
            raise StudyError(
                f"loss is {loss} at step {i} under setup {setup.name!r} "
                f"({setup.description}); a setup expected to train stably diverged. "
                f"Try a lower --lr (now {cfg.lr}).")
        if mngr is not None and cfg.checkpoint_every > 0 and (i + 1) % cfg.checkpoint_every \
                == 0 and i + 1 < cfg.steps:
            _save(mngr, state, history, record)
    if mngr is not None and cfg.checkpoint_every > 0 and diverged_at is None \
            and mngr.latest_step() != int(state.step):
        _save(mngr, state, history, record)
    if mngr is not None:
        mngr.close()

    with jax.numpy_dtype_promotion("standard"):
        mem = ledger(state.params, make_optimizer(setup, cfg))
    return TrainResult(
        setup=setup.name, history=history, steps_done=len(history["loss"]),
        diverged_at=diverged_at, compile_seconds=compile_seconds,
        step_ms=float(np.median(times) * 1e3) if times else float("nan"),
        first_step_seconds=first_step, bytes_per_param=mem.bytes_per_param,
        memory=mem.as_dict(), resumed_from=resumed_from, state=state)
