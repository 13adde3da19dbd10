"""The train state and the train step of one setup (no I/O, no caches).

One step, with ``S`` the loss scale (1 without scaling)::

    logits = model.apply({"params": p, "fp8_state": s}, tokens)     (policy applied)
    loss = lm_loss(f32(logits), tokens) [+ aux_loss_weight * aux for MoE]
    g, obs = grad(S * loss) w.r.t. (p, s)
    updates, opt_state = opt.update(g, opt_state, p)           (make_optimizer)
    p = optax.apply_updates(p, updates)     (exact round(master) under master_weights)
    s = fmtkit.fp8.update_state(s, obs)     (delayed recipe only; not on a skipped step)

Determinism: the parameters come from ``jax.random.PRNGKey(cfg.seed)`` (in f32, then rounded
to each setup's parameter dtype, so all setups start from the same point); stochastic
rounding from seeds in the optimizer state.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

import fmtkit
from fmtkit import optim
from fmtkit.fp8 import update_state as fp8_update_state
from fmtkit.policy import Rules, keep_blocks
from studies.lib import regimes
from studies.lib.models import TransformerConfig, TransformerLM, lm_loss
from studies.training import mesh
from studies.training.config import TrainConfig
from studies.training.metrics import step_metrics
from studies.training.optimizer import make_optimizer
from studies.training.setups import Setup, get_setup

__all__ = ["TrainState", "build_model", "init_params", "make_train_step", "setup_rules"]

F32 = jnp.float32


class TrainState(NamedTuple):
    """Everything a run needs to continue (a pytree; ``train`` checkpoints all of it).

    Attributes:
      params: the model parameters in their stored dtypes.
      opt_state: the optimizer state (moments, loss scale, master weights, ...).
      fp8_state: the Flax "fp8_state" collection (delayed-scaling amax histories); ``{}``
        when the policy has no delayed recipe.
      step: int32, steps done = the index of the next batch.
      rng: uint32[2], a PRNG key advanced every step (the
        token-grad-outliers regime draws its outlier positions from it).
    """

    params: Any
    opt_state: Any
    fp8_state: Any
    step: jax.Array
    rng: jax.Array


def build_model(setup: Setup, cfg: TrainConfig) -> Any:
    """``fmtkit.with_policy(TransformerLM(cfg.model_config()), setup_rules(setup, cfg))``."""
    return fmtkit.with_policy(TransformerLM(cfg.model_config()), setup_rules(setup, cfg))


def setup_rules(setup: Setup, cfg: TrainConfig) -> Rules:
    """The setup's rules, with its last ``keep_last`` blocks kept out of its FP8/FP4 recipe
    (by position in the model's stack, ``fmtkit.policy.keep_blocks``).

    Raises:
      ValueError: ``keep_last`` not smaller than the model's number of blocks.
    """
    mcfg = cfg.model_config()
    rules = setup.rules()
    if setup.keep_last:
        if setup.keep_last >= mcfg.num_layers:
            raise ValueError(
                f"setup {setup.name!r} keeps its last {setup.keep_last} block(s) in BF16, so "
                f"it needs more than {setup.keep_last} blocks; the model has "
                f"{mcfg.num_layers} (use --regime fp4-training or --num-layers).")
        dummy = jnp.zeros((cfg.batch, cfg.seq_len), jnp.int32)
        paths = fmtkit.module_paths(TransformerLM(mcfg), dummy)
        rules = keep_blocks(rules, paths, last=setup.keep_last)
    return rules


def init_params(cfg: TrainConfig) -> Any:
    """The f32 initial parameters every setup starts from: ``TransformerLM.init`` with
    ``PRNGKey(cfg.seed)``. Compute them once and pass them to ``make_train_step`` to share
    one initialization between setups (the compiled init is shared by every seed)."""
    dummy = jnp.zeros((cfg.batch, cfg.seq_len), jnp.int32)
    return _jitted_init(cfg.model_config())(jax.random.PRNGKey(cfg.seed), dummy)["params"]


@functools.lru_cache(maxsize=8)
def _jitted_init(model_config: TransformerConfig) -> Callable:
    """``jax.jit(TransformerLM(model_config).init)``, one per model (a compile is ~1 s)."""
    return jax.jit(TransformerLM(model_config).init)


def make_train_step(setup: Setup | str, cfg: TrainConfig, *, params: Any = None,
                    with_grads: bool = False) -> tuple[Callable[[], TrainState],
                               Callable[[TrainState, jax.Array], tuple[TrainState, dict]]]:
    """The init and (jitted) step functions of one setup; no I/O.

    Each call builds new functions (and ``jax.jit`` compiles the step on first use): keep
    the pair to reuse the compiled step, e.g. for several runs of one setup.

    Args:
      setup: a ``Setup`` or a registered name.
      cfg: the training configuration.
      params: the f32 initial parameters (``init_params(cfg)``; computed by ``init_fn`` when
        None).
      with_grads: the metrics also hold ``"grads"``, the step's parameter gradient as the
        optimizer receives it (times the loss scale, if any): telemetry that needs the
        setup's gradient reads it from this compile instead of compiling it again. The new
        state is the same as without it (tested); the loss metric may differ in its last
        bit (XLA fuses the loss reduction differently once the gradient is an output).

    Returns:
      ``(init_fn, step_fn)``: ``init_fn() -> TrainState`` (step 0; the f32 initial
      parameters rounded to the policy's parameter dtypes, committed to the state's
      sharding as a restored checkpoint is); ``step_fn(state, tokens) -> (state, metrics)``,
      jitted, tokens int32 ``[cfg.batch, cfg.seq_len]`` from ``batch_at``, metrics as in
      ``studies.training.metrics``. The step traces once for any number of steps (nothing
      that changes per step is static).

    Raises:
      ValueError: unknown setup; batch/model sizes an FP8 recipe of the setup cannot tile;
        ``cfg.data_parallel`` larger than the number of local devices.
    """
    setup = get_setup(setup)
    state_sharding = mesh.state_sharding(cfg.data_parallel)
    model = build_model(setup, cfg)
    opt = make_optimizer(setup, cfg)
    scaled = setup.loss_scaling != "none"
    moe = cfg.model_config().num_experts > 0
    # Regimes acting on the loss whose gradient is taken (the reported loss is unweighted).
    loss_weight = (regimes.TokensPerUpdate().loss_weight(cfg.batch * (cfg.seq_len - 1))
                   if cfg.regime == "tokens-per-update" else 1.0)
    token_outliers = (regimes.TokenGradOutliers() if cfg.regime == "token-grad-outliers"
                      else None)
    dummy = jnp.zeros((cfg.batch, cfg.seq_len), jnp.int32)
    key = jax.random.PRNGKey(cfg.seed)
    shapes = jax.eval_shape(model.init, key, dummy)

    # Outlier features: the rows of the kernels that read the scaled channels stay at zero.
    reader_mask = None
    if cfg.regime == "outlier-features":
        reader_mask = regimes.OutlierFeatures().reader_mask(shapes["params"],
                                                             cfg.model_config().d_model)

    def init_fn() -> TrainState:
        ref = init_params(cfg) if params is None else params
        if reader_mask is not None:
            ref = jax.tree.map(lambda x, m: x * m, ref, reader_mask)
        p = jax.tree.map(lambda x, s: x.astype(s.dtype), ref, shapes["params"])
        fp8_state = (jax.jit(lambda k: model.init(k, dummy)["fp8_state"])(key)
                     if "fp8_state" in shapes else {})
        with jax.numpy_dtype_promotion("standard"):
            opt_state = opt.init(p)
        state = TrainState(p, opt_state, fp8_state, jnp.zeros([], jnp.int32),
                           jax.random.fold_in(key, 1))
        # Committed, as a restored checkpoint is: a resumed run reuses the compiled step.
        return jax.device_put(state, state_sharding)

    def loss_fn(p, fp8_state, tokens, scale, rng):
        variables = {"params": p}
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
        total = loss
        if token_outliers is not None:
            weights = token_outliers.loss_weights(rng, (tokens.shape[0], tokens.shape[1] - 1))
            total = regimes.weighted_lm_loss(logits.astype(F32), tokens, weights)
        if aux is not None:
            total = total + jnp.float32(cfg.aux_loss_weight) * aux
        if loss_weight != 1.0:
            total = total * jnp.float32(loss_weight)
        return total * scale, loss

    def step_fn(state: TrainState, tokens: jax.Array) -> tuple[TrainState, dict]:
        scale = optim.loss_scale(state.opt_state) if scaled else jnp.ones([], F32)
        (_, loss), (grads, obs) = jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True)(
            state.params, state.fp8_state, tokens, scale, state.rng)
        if reader_mask is not None:
            grads = jax.tree.map(lambda g, m: g * m.astype(g.dtype), grads, reader_mask)
        with jax.numpy_dtype_promotion("standard"):  # optax mixes f32 schedules and bf16
            updates, opt_state = opt.update(grads, state.opt_state, state.params)
            new_params = optax.apply_updates(state.params, updates)
        metrics = step_metrics(loss=loss, scale=scale, grads=grads,
                               grad_format=setup.grad_format, params_before=state.params,
                               params_after=new_params, opt_state_before=state.opt_state,
                               opt_state_after=opt_state)
        if with_grads:
            metrics["grads"] = grads
        fp8_state = state.fp8_state
        if fp8_state:
            fp8_state = fp8_update_state(fp8_state, obs)
            # A skipped step's amaxes are inf/NaN: keep them out of the history.
            fp8_state = optax.tree.where(metrics["skipped"] == 0, fp8_state, state.fp8_state)
        new = TrainState(new_params, opt_state, fp8_state, state.step + 1,
                         jax.random.split(state.rng)[0])
        return new, metrics

    if mesh.is_sharded(cfg.data_parallel):  # a mesh (over all processes)
        return init_fn, jax.jit(step_fn, in_shardings=(state_sharding,
                                                       mesh.batch_sharding(cfg.data_parallel)),
                                out_shardings=(state_sharding, state_sharding))
    return init_fn, jax.jit(step_fn)
