"""The training engine of the FP8 dose-response studies: outliers set per run and per step.

The studies ``outlier-dose``, ``delayed-lag``, ``grad-blocks`` and ``fp8-long`` train the
byte-level ``studies.lib.models.TransformerLM`` under one setup (``studies.training.setups``)
for several *runs* at once: a run is (seed, outlier magnitude, gradient-outlier
magnitude), and all runs of a setup share one compiled step, ``jax.jit(jax.vmap(step))``.
Because the magnitudes are values of the train state rather than constants of the model,
five magnitudes times three seeds cost one compile.

Activation outliers (``magnitude`` > 1): as ``studies.lib.regimes.OutlierFeatures``, one
channel of what every block's ``ln_1`` and ``ln_2`` put out (the input of the attention
projections and of the MLP's first GEMM) is multiplied by the magnitude, here through the
norms' own ``scale`` parameters (``scale * v`` with ``v`` = 1 except the outlier channel;
the trained parameter is ``scale``, its gradient flows through the product): the way a
large norm gain makes outlier features in LLMs [Wei22 in ``studies.lib.regimes``]. The
channel is ``OutlierFeatures().outlier_channels(d_model)`` and the rows of the kernels
that read it start at zero and get no gradient (``OutlierFeatures.reader_mask``), so in
exact arithmetic the model computes what it computes without outliers and only the
quantizers see them. A ``Ramp`` grows the magnitude geometrically over a range of steps
(an emergent outlier feature); without one it is there from step 0.

Token-gradient outliers (``grad_magnitude`` > 1): as ``studies.lib.regimes.TokenGradOutliers``
(1/256 of the predicted tokens weighted ``grad_magnitude`` times the others in the loss
whose gradient is taken, weights of mean 1, new positions every step), with the magnitude a
value of the state. The reported loss is always the unweighted one.

Every step records, per run: ``loss``, ``grad_norm`` (global, before clipping),
``nonfinite`` (inf/NaN gradient elements; ``studies.training.monitor``), and for the first
block's attention input x (the GEMM input the outlier reaches first, in bf16 as the
projections read it): ``amax`` (max |x|),
``amax_used`` (the per-tensor amax its FP8 quantization divides by: the current amax, or,
under a delayed recipe, the largest of the amax history before this step), ``saturated``
(elements with |x| > amax_used: clipped to E4M3's 448) and ``sqnr_normal`` (dB, of the
channels other than the outlier after per-tensor E4M3 quantization with ``amax_used``).

Resuming: each (setup, runs) unit's results are written as JSON to a folder as soon as
the unit ends; a study given that folder (``--resume``) loads the units already there
(same configuration, checked by a key) and trains only the rest.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import time
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

import fmtkit
from fmtkit.casting import cast
from fmtkit.fp8 import Fp8Recipe, get_recipe
from fmtkit.fp8 import update_state as fp8_update_state
from fmtkit.policy import Policy, Rules, get_preset
from studies.lib import regimes
from studies.lib.common import Progress, no_progress, to_jsonable
from studies.lib.models import TransformerConfig, TransformerLM, lm_loss
from studies.training import multiseed
from studies.training.config import TrainConfig
from studies.training.data import batch_at, load_data
from studies.training.monitor import grad_norm, monitor_summary, nonfinite_count
from studies.training.optimizer import make_optimizer
from studies.training.setups import SETUPS, Setup
from studies.training.step import TrainState, init_params

__all__ = ["E4M3_MAX", "PROBE_DOT", "Ramp", "Run", "RunState", "fp8_setup", "make_step",
           "outlier_channel", "ramp_magnitude", "token_weights", "train_unit", "unit_key",
           "wide_model", "with_outlier"]

F32 = jnp.float32

E4M3_MAX = 448.0
"""E4M3's largest finite value (OCP FP8 v1.0): per-tensor scaling maps the amax there."""

PROBE_DOT = "Block_0/attn/query:dot0"
"""The delayed-scaling state whose x history scales the first block's attention input
(key and value read the same input and record the same amax)."""

GRAD_OUTLIER_FRACTION = regimes.TokenGradOutliers().fraction
"""Share of predicted tokens that carry the gradient outliers (1/256: the regime's)."""


def wide_model(seq_len: int, d_model: int = 256, d_ff: int = 512) -> TransformerConfig:
    """The one-block model of the outlier studies at ``d_model`` (default 256: two 1x128
    tiles per row, so a 1x128 tile separates the outlier channel from the normal ones, as
    ``fmtkit study fp8-outliers`` takes its normal channels outside the outlier's 128-block)."""
    return TransformerConfig(d_model=d_model, num_heads=4, num_layers=1, d_ff=d_ff,
                             max_len=seq_len)


def outlier_channel(d_model: int) -> int:
    """The outlier channel (``OutlierFeatures().outlier_channels(d_model)``, one channel)."""
    return int(regimes.OutlierFeatures().outlier_channels(d_model)[0])


def fp8_setup(name: str, recipe: Fp8Recipe | str) -> Setup:
    """bf16-mixed with ``recipe`` on every linear layer (as ``fmtkit``'s ``fp8-*`` presets
    are built), named ``name``; a registered setup name returns that setup."""
    if isinstance(recipe, str) and recipe in SETUPS:
        return SETUPS[recipe]
    recipe = get_recipe(recipe)
    mixed = get_preset("bf16-mixed")
    rules = Rules(mixed.rules, default=Policy("float32", "bfloat16", "bfloat16", fp8=recipe),
                  head=mixed.head, output_dtype=mixed.output_dtype, check_unmatched=False)
    return Setup(name, rules, grad_format="bfloat16",
                 description=f"bf16-mixed + FP8 {recipe} on the linear layers")


@dataclasses.dataclass(frozen=True)
class Run:
    """One member of a vmapped unit.

    Attributes:
      seed: initial parameters and batches (``TrainConfig.with_seed``).
      magnitude: the activation outlier channel's (final) magnitude; 1: no outlier.
      grad_magnitude: the token-gradient outliers' loss weight; 1: none.
    """

    seed: int
    magnitude: float = 1.0
    grad_magnitude: float = 1.0


@dataclasses.dataclass(frozen=True)
class Ramp:
    """When the outlier grows: magnitude 1 before ``start``, then geometric growth to the
    full magnitude over ``steps`` steps (``ramp_magnitude``); ``steps=0``: the full
    magnitude from ``start`` on."""

    start: int = 0
    steps: int = 0

    def __post_init__(self):
        for name in ("start", "steps"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name} must be an int >= 0, got {v!r}.")


def ramp_magnitude(magnitude: jax.typing.ArrayLike, step: jax.typing.ArrayLike,
                   ramp: Ramp) -> jax.Array:
    """The outlier magnitude at ``step``: ``magnitude ** f`` with f = 0 before
    ``ramp.start``, (step - start) / steps during the ramp, 1 after it (f32)."""
    m = jnp.asarray(magnitude, F32)
    s = jnp.asarray(step, F32)
    if ramp.steps == 0:
        f = (s >= ramp.start).astype(F32)
    else:
        f = jnp.clip((s - ramp.start) / F32(ramp.steps), 0.0, 1.0)
    return jnp.exp(f * jnp.log(m))


def token_weights(key: jax.Array, shape: tuple[int, ...], magnitude: jax.typing.ArrayLike,
                  fraction: float = GRAD_OUTLIER_FRACTION) -> jax.Array:
    """``TokenGradOutliers.loss_weights`` with a traced magnitude: ``max(1, round(fraction
    * n))`` positions weighted ``magnitude``, the rest 1, divided by their mean."""
    n = math.prod(shape)
    k = max(1, round(fraction * n))
    idx = jax.random.choice(key, n, (k,), replace=False)
    w = jnp.ones(n, F32).at[idx].set(jnp.asarray(magnitude, F32))
    return (w / jnp.mean(w)).reshape(shape)


def with_outlier(params: Any, magnitude: jax.typing.ArrayLike, channel: int,
                 d_model: int) -> Any:
    """``params`` with every block's ``ln_1`` / ``ln_2`` scale multiplied by the channel
    vector (1, ``magnitude`` at ``channel``)."""
    v = jnp.ones(d_model, F32).at[channel].set(jnp.asarray(magnitude, F32))

    def one(path, x):
        names = [str(getattr(k, "key", k)) for k in path]
        if len(names) >= 2 and names[-2] in ("ln_1", "ln_2") and names[-1] == "scale":
            return x * v.astype(x.dtype)
        return x

    return jax.tree_util.tree_map_with_path(one, params)


class RunState(NamedTuple):
    """The vmapped state of one run: the train state and the run's magnitudes (f32)."""

    train: TrainState
    magnitude: jax.Array
    grad_magnitude: jax.Array


def _is_delayed(setup: Setup) -> bool:
    return any(r.delayed for r in setup.fp8_recipes())


def make_step(setup: Setup, cfg: TrainConfig, *, outliers: bool, ramp: Ramp = Ramp(),
              grad_outliers: bool = False):
    """The (unjitted, single-run) step ``(RunState, tokens) -> (RunState, metrics)``.

    Args:
      setup: the setup (policy, optimizer).
      cfg: the training configuration (``model`` set to the model trained).
      outliers: scale the outlier channel by the run's magnitude (``ramp``) and keep its
        readers' rows at zero.
      ramp: when the outlier grows.
      grad_outliers: weight the loss per token (``token_weights``) by the run's
        ``grad_magnitude``.
    """
    mcfg = cfg.model_config()
    d = mcfg.d_model
    ch = outlier_channel(d)
    model = fmtkit.with_policy(TransformerLM(mcfg), setup.rules())
    opt = make_optimizer(setup, cfg)
    delayed = _is_delayed(setup)
    dummy = jnp.zeros((cfg.batch, cfg.seq_len), jnp.int32)
    shapes = jax.eval_shape(model.init, jax.random.PRNGKey(0), dummy)
    mask = (regimes.OutlierFeatures().reader_mask(shapes["params"], d) if outliers else None)
    normal = jnp.arange(d) != ch
    capture = lambda mdl, name: mdl.name == "ln_1"  # noqa: E731

    def loss_fn(p, fp8_state, tokens, mag, gmag, rng):
        if outliers:
            p = with_outlier(p, mag, ch, d)
        variables = {"params": p}
        if fp8_state:
            variables["fp8_state"] = fp8_state
        logits, inter = model.apply(variables, tokens, capture_intermediates=capture,
                                    mutable=["intermediates"])
        (x0,) = inter["intermediates"]["Block_0"]["ln_1"]["__call__"]
        logits = logits.astype(F32)
        loss = lm_loss(logits, tokens)
        total = loss
        if grad_outliers:
            w = token_weights(rng, (tokens.shape[0], tokens.shape[1] - 1), gmag)
            total = regimes.weighted_lm_loss(logits, tokens, w)
        return total, (loss, x0)

    def step(rs: RunState, tokens: jax.Array) -> tuple[RunState, dict[str, jax.Array]]:
        st = rs.train
        mag = ramp_magnitude(rs.magnitude, st.step, ramp) if outliers else jnp.ones([], F32)
        (_, (loss, x0)), (grads, obs) = jax.value_and_grad(
            loss_fn, argnums=(0, 1), has_aux=True)(st.params, st.fp8_state, tokens, mag,
                                                   rs.grad_magnitude, st.rng)
        if mask is not None:
            grads = jax.tree.map(lambda g, m: g * m.astype(g.dtype), grads, mask)
        with jax.numpy_dtype_promotion("standard"):
            updates, opt_state = opt.update(grads, st.opt_state, st.params)
            new_params = optax.apply_updates(st.params, updates)
        fp8_state = st.fp8_state
        # As the projections read it: the norm's output in the compute dtype (bf16), whose
        # amax is the one the delayed history records.
        x = x0.astype(jnp.bfloat16).astype(F32).reshape(-1, d)
        amax = jnp.max(jnp.abs(x))
        used = amax
        if delayed:
            hist = jnp.max(jnp.asarray(st.fp8_state[PROBE_DOT])[0])  # [3, history]: x first
            used = jnp.where(hist > 0, hist, amax)  # the first step bootstraps from x
        if fp8_state:
            fp8_state = fp8_update_state(fp8_state, obs)
        scale = jnp.maximum(used, jnp.finfo(F32).tiny) / F32(E4M3_MAX)
        q = cast(jnp.clip(x / scale, -E4M3_MAX, E4M3_MAX), "e4m3").astype(F32) * scale
        sig = jnp.sum(jnp.where(normal, x * x, 0.0))
        err = jnp.sum(jnp.where(normal, (q - x) ** 2, 0.0))
        metrics = {
            "loss": loss, "grad_norm": grad_norm(grads), "nonfinite": nonfinite_count(grads),
            "magnitude": mag, "amax": amax, "amax_used": used,
            "saturated": jnp.sum(jnp.abs(x) > used, dtype=jnp.int32),
            "sqnr_normal": 10.0 * jnp.log10(sig / jnp.maximum(err, jnp.finfo(F32).tiny)),
        }
        new = TrainState(new_params, opt_state, fp8_state, st.step + 1,
                         jax.random.split(st.rng)[0])
        return RunState(new, rs.magnitude, rs.grad_magnitude), metrics

    return step, mask


METRICS = ("loss", "grad_norm", "nonfinite", "magnitude", "amax", "amax_used", "saturated",
           "sqnr_normal")
"""The per-step metrics of ``make_step`` (module docstring)."""


def unit_key(study: str, setup: Setup, cfg: TrainConfig, runs: tuple[Run, ...],
             extra: Any = None) -> str:
    """A short hash naming a unit: what it trains (setup, config, runs, ramp...)."""
    text = json.dumps(to_jsonable({"study": study, "setup": setup.name,
                                   "rules": str(setup.policy), "cfg": cfg,
                                   "runs": runs, "extra": extra}), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _init_state(setup: Setup, cfg: TrainConfig, run: Run, params: Any, mask: Any,
                model: Any) -> RunState:
    p = params if mask is None else jax.tree.map(lambda x, m: x * m, params, mask)
    dummy = jnp.zeros((cfg.batch, cfg.seq_len), jnp.int32)
    key = jax.random.PRNGKey(run.seed)
    opt = make_optimizer(setup, cfg.with_seed(run.seed))
    variables = jax.eval_shape(model.init, key, dummy)
    p = jax.tree.map(lambda x, s: x.astype(s.dtype), p, variables["params"])
    fp8_state = (jax.jit(lambda k: model.init(k, dummy)["fp8_state"])(key)
                 if "fp8_state" in variables else {})
    with jax.numpy_dtype_promotion("standard"):
        opt_state = opt.init(p)
    st = TrainState(p, opt_state, fp8_state, jnp.zeros([], jnp.int32),
                    jax.random.fold_in(key, 1))
    return RunState(st, jnp.asarray(run.magnitude, F32), jnp.asarray(run.grad_magnitude, F32))


def train_unit(setup: Setup, cfg: TrainConfig, runs: tuple[Run, ...], *,
               outliers: bool = False, ramp: Ramp = Ramp(), grad_outliers: bool = False,
               progress: Progress = no_progress, data: np.ndarray | None = None,
               cache: Path | None = None, study: str = "fp8", keep_state: bool = False
               ) -> dict[str, Any]:
    """Trains every run of one setup with one vmapped step; JSON-ready results.

    Args:
      setup, cfg, runs: what to train (``cfg.model`` the model; ``cfg.steps`` steps).
      outliers, ramp, grad_outliers: as ``make_step``.
      progress: progress-bar factory (one bar over the steps).
      data: the training bytes (``load_data(cfg)`` if None).
      cache: a folder: a unit already there (same ``unit_key``) is loaded instead of
        trained, and a trained one is written there.
      study: the study's name (part of the key).
      keep_state: also return the final stacked ``RunState`` (key ``"state"``; not cached).

    Returns:
      ``{"setup", "key", "runs": [{"seed", "magnitude", "grad_magnitude", "history"
      (METRICS per step), "final_loss", "monitor"}], "compile_seconds", "step_ms",
      "wall_seconds", "cached"}``.
    """
    key = unit_key(study, setup, cfg, runs, {"outliers": outliers, "ramp": ramp,
                                             "grad_outliers": grad_outliers})
    path = None if cache is None else Path(cache) / f"{setup.name}-{key}.json"
    if path is not None and path.is_file() and not keep_state:
        out = json.loads(path.read_text())
        out["cached"] = True
        return out
    t0 = time.perf_counter()
    if data is None:
        data = load_data(cfg)
    step, mask = make_step(setup, cfg, outliers=outliers, ramp=ramp,
                           grad_outliers=grad_outliers)
    model = fmtkit.with_policy(TransformerLM(cfg.model_config()), setup.rules())
    params = {s: init_params(cfg.with_seed(s)) for s in dict.fromkeys(r.seed for r in runs)}
    state = multiseed.stack([_init_state(setup, cfg, r, params[r.seed], mask, model)
                             for r in runs])
    vstep = jax.jit(jax.vmap(step))

    def batches(i: int) -> jax.Array:
        return jnp.asarray(np.stack([batch_at(data, cfg.with_seed(r.seed), i) for r in runs]))

    t1 = time.perf_counter()
    compiled = vstep.lower(state, batches(0)).compile()
    compile_seconds = time.perf_counter() - t1
    hist: list[dict[str, list[float]]] = [{k: [] for k in METRICS} for _ in runs]
    times = []
    for i in progress(range(cfg.steps), total=cfg.steps, desc=setup.name):
        tokens = batches(i)
        t = time.perf_counter()
        state, metrics = compiled(state, tokens)
        metrics = jax.device_get(metrics)
        if i:
            times.append(time.perf_counter() - t)
        for j in range(len(runs)):
            for k in METRICS:
                hist[j][k].append(float(metrics[k][j]))
    out_runs = []
    for r, h in zip(runs, hist):
        k = max(1, len(h["loss"]) // 10)
        out_runs.append({"seed": r.seed, "magnitude": r.magnitude,
                         "grad_magnitude": r.grad_magnitude, "history": h,
                         "final_loss": float(np.mean(h["loss"][-k:])),
                         "monitor": monitor_summary(h)})
    out = {"setup": setup.name, "key": key, "runs": out_runs,
           "compile_seconds": compile_seconds,
           "step_ms": float(np.median(times) * 1e3) if times else float("nan"),
           "wall_seconds": time.perf_counter() - t0, "cached": False}
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(to_jsonable(out)))
    if keep_state:
        out["state"] = state
    return out


def units_folder(resume: str | None, work_dir: str, study: str) -> Path:
    """Where a study's units go: ``resume`` (an earlier run's units, reused), else a new
    ``work_dir/<study>-<timestamp>`` folder."""
    if resume is not None:
        return Path(resume)
    return Path(work_dir) / f"{study}-{time.strftime('%Y%m%d-%H%M%S')}"


def check_magnitudes(magnitudes: tuple[float, ...]) -> None:
    """``ValueError`` unless ``magnitudes`` is a non-empty sequence of finite numbers >= 1
    (an outlier channel's multiplier)."""
    if not magnitudes or not all(isinstance(m, (int, float)) and math.isfinite(m) and m >= 1
                                 for m in magnitudes):
        raise ValueError(f"magnitudes must be finite numbers >= 1, got {magnitudes!r}.")


def check_parallel(parallel: int) -> None:
    """``ValueError`` unless ``parallel`` (setups trained at a time) is an int >= 1."""
    if isinstance(parallel, bool) or not isinstance(parallel, int) or parallel < 1:
        raise ValueError(f"parallel must be an int >= 1, got {parallel!r}.")


def check_resume(resume: str | None) -> None:
    """``ValueError`` when ``--resume`` names no folder."""
    if resume is not None and not Path(resume).is_dir():
        raise ValueError(f"--resume {resume!r}: no such folder (give the units folder an "
                         "earlier run printed).")


def final_losses(unit: dict[str, Any], **match: float) -> list[float]:
    """The final losses of a unit's runs whose fields equal ``match``, in seed order."""
    rows = [r for r in unit["runs"] if all(r[k] == v for k, v in match.items())]
    return [r["final_loss"] for r in sorted(rows, key=lambda r: r["seed"])]


def seeds_of(cfg: TrainConfig) -> tuple[int, ...]:
    """The seeds of ``cfg`` (``cfg.seed_list``)."""
    return cfg.seed_list


def replace_model(cfg: TrainConfig, model: TransformerConfig) -> TrainConfig:
    """``cfg`` training ``model`` (regime none: the studies apply their outliers)."""
    return dataclasses.replace(cfg, model=model, regime="none")
