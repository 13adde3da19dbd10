"""Study ``sensitivity``: lower one module at a time and rank modules by the damage ("which
layers can go to FP8?").

Seed 002 asks for an automated per-layer sensitivity tool ("不同网络层对精度的敏感度差异巨大 ...
建议开发一个自动化敏感度分析工具"). For a model, its parameters and one batch, the study runs

* the reference: every module in float32 (``fmtkit.with_policy`` with the default policy
  ``p=f32,c=f32,o=f32,g=f32``);
* for each selected module ``M``: the same model with ``Rules([("^M$", target)],
  default=f32)``: only ``M`` computes in the target precision (its parameters cast at use,
  its inputs cast to the compute dtype, its output cast, the cotangent entering it rounded),

and reports, per module, the change in loss, the SQNR of the logits and of the whole
parameter gradient against the reference, and the SQNR of the module's own parameter
gradients:

    SQNR(ref, y) = 10 log10( sum ref^2 / sum (y - ref)^2 )  dB      (inf when y == ref)

Targets: ``fp32`` (a control: nothing changes), ``bf16``, ``fp16`` (``p=f32,c=X,o=f32,g=X``:
the module computes in X, its cotangent is rounded to X, and its already-rounded output is
handed on as f32; no loss scaling, so fp16 gradient underflow counts), ``fp8-<recipe>`` (an
FP8 recipe from ``fmtkit.fp8.RECIPES`` as ``p=f32,c=bf16,o=f32,g=bf16`` plus the recipe on
the module's matmul; modules without a ``dot_general`` hook, norms, embeddings and the
attention core, get bf16 only and are marked so), or any policy string
(``p=f32,c=bf16,o=bf16``).

Modules: every module that has parameters of its own, plus attention modules (their own
computation is the QK^T / softmax / PV core; the projections are separate rows); containers
(``Block_0``, ``MlpBlock_0``, the model) are skipped. ``modules`` filters by regex.

The default model is the byte-level transformer of ``studies.training`` (size preset "tiny":
d_model 128, d_ff 256, every matmul tiles into 128 blocks; here with 2 layers) trained for
``train.steps`` steps in f32 on the embedded corpus (``--no-pretrain``: random
initialization), evaluated on a batch the training never saw.

    fmtkit study sensitivity [--target fp8-blockwise] [--modules 'Block_0/'] [--rank-by loss]
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from pathlib import Path
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

import fmtkit
from fmtkit.fp8 import RECIPES
from fmtkit.policy import Policy, Rules, module_paths
from fmtkit.telemetry import compare
from studies.lib.common import figure, format_table, no_progress, plot_style, save
from studies.lib.models import TransformerConfig, TransformerLM, lm_loss
from studies.training.config import TrainConfig

# How the command line lists this study (studies.app.registry).
NAME = "sensitivity"
SUMMARY = "lower one module at a time to bf16/fp16/FP8 and rank modules by the damage"
ORDER = 110

__all__ = ["F32", "Config", "candidate_modules", "evaluate", "plot", "prepare", "run",
           "sqnr_db", "summarize", "target_value"]

F32 = "p=f32,c=f32,o=f32,g=f32"
"""The policy of every module that is not lowered (and of the reference)."""

# The lowered module computes in the low precision and hands its (already rounded) output on
# as f32, so the f32 rest of the model sees exactly what a low-precision module produced.
_NAMED_TARGETS = {"fp32": F32, "f32": F32, "bf16": "p=f32,c=bf16,o=f32,g=bf16",
                  "fp16": "p=f32,c=f16,o=f32,g=f16"}
_DOT_TYPES = ("Dense", "DenseGeneral")  # linen layers with a dot_general hook


def target_value(target: str) -> Policy:
    """The policy of the lowered module for a target name (FP8 targets: f32 params, bf16
    compute, the recipe on the matmul, output handed on in f32).

    Raises:
      ValueError: an unknown target (the message lists the valid forms).
    """
    if not isinstance(target, str):
        raise TypeError(f"target must be a str, got {type(target).__name__}.")
    if target in _NAMED_TARGETS:
        return Policy.parse(_NAMED_TARGETS[target])
    if target.startswith("fp8-") and target[4:] in RECIPES:
        return Policy("float32", "bfloat16", "float32", "bfloat16", fp8=RECIPES[target[4:]])
    try:
        return Policy.parse(target)
    except ValueError:
        raise ValueError(
            f"target must be one of {', '.join(_NAMED_TARGETS)}, fp8-<recipe> with recipe in "
            f"{', '.join(RECIPES)}, or a policy string like 'p=f32,c=bf16'; got {target!r}."
        ) from None


@dataclasses.dataclass(frozen=True)
class Config:
    """Configuration of the ``sensitivity`` study.

    Attributes:
      target: the precision a module is lowered to: fp32 (control), bf16, fp16,
        fp8-<recipe> (current, delayed, rowwise, blockwise, mxfp8) or a policy string.
      modules: regex; only module paths it matches (re.search) are lowered ("" = all).
      rank_by: sort key, most sensitive first: grad_sqnr, output_sqnr or loss (|change|).
      pretrain: train the model in f32 for ``train.steps`` steps before the measurement
        (--no-pretrain: measure at the random initialization).
      execution: "jit" compiles every variant (seconds each on a CPU), "eager" runs them op
        by op (one warm-up, then fast: better for many modules), "auto" picks jit for up
        to 8 modules. The reference runs the same way.
      train: the model (size preset, num_layers) and its brief f32 training (steps, lr,
        seed; batch and seq_len are also those of the measured batch).
    """

    target: str = "fp8-blockwise"
    modules: str = ""
    rank_by: Literal["grad_sqnr", "output_sqnr", "loss"] = "grad_sqnr"
    pretrain: bool = True
    execution: Literal["auto", "jit", "eager"] = "auto"
    train: TrainConfig = TrainConfig(steps=60, warmup=10, num_layers=2)

    def __post_init__(self):
        target_value(self.target)
        if self.execution not in ("auto", "jit", "eager"):
            raise ValueError(f"execution must be 'auto', 'jit' or 'eager', got "
                             f"{self.execution!r}.")
        try:
            re.compile(self.modules)
        except re.error as err:
            raise ValueError(f"modules must be a valid regex, got {self.modules!r}: "
                             f"{err}.") from None
        if self.rank_by not in ("grad_sqnr", "output_sqnr", "loss"):
            raise ValueError(f"rank_by must be grad_sqnr, output_sqnr or loss, got "
                             f"{self.rank_by!r}.")
        if not isinstance(self.train, TrainConfig):
            raise TypeError(f"train must be a studies.training.TrainConfig, got "
                            f"{type(self.train).__name__}.")

    @property
    def train_steps(self) -> int:
        """f32 training steps before the measurement (0 without ``pretrain``)."""
        return self.train.steps if self.pretrain else 0


def prepare(config: Config, progress=no_progress
            ) -> tuple[TransformerConfig, Any, jax.Array]:
    """``(model config, f32 params, tokens)``: the model, trained ``train.steps`` steps in
    f32 (``studies.training``, setup "fp32") unless ``pretrain`` is off, and a batch the
    training never saw."""
    from studies import training

    tcfg = config.train
    mcfg = tcfg.model_config()
    data = training.load_data(tcfg)
    if config.pretrain:
        params = training.train("fp32", tcfg, progress=progress, data=data).state.params
    else:  # the initial parameters every studies.training setup starts from
        params = training.init_params(tcfg)
    # A batch index beyond the training steps: not a training batch.
    tokens = jnp.asarray(training.batch_at(data, tcfg, 10**6 + config.train_steps))
    return mcfg, params, tokens


def candidate_modules(mcfg: TransformerConfig, tokens: Any, pattern: str = ""
                      ) -> dict[str, str]:
    """``{path: class name}`` of the modules the study lowers: those with parameters of their
    own and attention modules, not containers, filtered by ``pattern`` (re.search)."""
    paths = module_paths(TransformerLM(mcfg), tokens)
    rx = re.compile(pattern)
    out = {}
    for path, kind in paths.items():
        if not path:
            continue
        container = any(p.startswith(path + "/") for p in paths)
        if container and "Attention" not in kind:
            continue
        if rx.search(path):
            out[path] = kind
    return out


def _rules(path: str | None, target: str) -> Rules:
    if path is None:
        return Rules((), default=F32)
    return Rules([(f"^{re.escape(path)}$", target_value(target))], default=F32)


@functools.lru_cache(maxsize=64)
def _variant(mcfg: TransformerConfig, path: str | None, target: str) -> tuple[Any, Any, Any]:
    """(policy-wrapped model, loss/logits/gradient function, its jit), cached per variant so
    that evaluating a variant again (tests, the reference) reuses its compilation."""
    model = fmtkit.with_policy(TransformerLM(mcfg), _rules(path, target))

    def fwd_bwd(p, e, toks):
        def loss_fn(p):
            logits = model.apply({"params": p, **e}, toks).astype(jnp.float32)
            return lm_loss(logits, toks), logits

        return jax.value_and_grad(loss_fn, has_aux=True)(p)

    return model, fwd_bwd, jax.jit(fwd_bwd)


def evaluate(mcfg: TransformerConfig, params: Any, tokens: jax.Array, path: str | None,
             target: str, *, jit: bool = True) -> dict[str, Any]:
    """Loss, logits (f32) and parameter gradients with only ``path`` lowered to ``target``
    (``path=None``: the all-f32 reference): one forward and backward, jit-compiled, or with
    ``jit=False`` op by op (JAX's eager execution; compiled pieces are reused across
    variants). Compare variants evaluated the same way: the two differ by XLA's fusion."""
    model, fwd_bwd, fwd_bwd_jit = _variant(mcfg, path, target)
    variables = jax.eval_shape(model.init, jax.random.PRNGKey(0), tokens)
    extra = {k: jax.jit(model.init)(jax.random.PRNGKey(0), tokens)[k] for k in variables
             if k != "params"}  # e.g. a delayed recipe's fp8_state (fresh histories)
    # JAX's default promotion: a user policy string may hand a bf16 output to an f32 residual
    # add, which the model (user code) leaves to promotion.
    with jax.numpy_dtype_promotion("standard"):
        (loss, logits), grads = (fwd_bwd_jit if jit else fwd_bwd)(params, extra, tokens)
    return {"loss": loss, "logits": logits, "grads": grads}


def sqnr_db(ref: Any, y: Any) -> float:
    """SQNR of ``y`` against ``ref`` in dB over all leaves (``fmtkit.telemetry.compare`` on the
    concatenated leaves, f32); inf when they are equal."""
    r = jnp.concatenate([jnp.ravel(x).astype(jnp.float32) for x in jax.tree.leaves(ref)])
    o = jnp.concatenate([jnp.ravel(x).astype(jnp.float32) for x in jax.tree.leaves(y)])
    return float(compare(r, o).sqnr_db)


def _subtree(tree: Any, path: str) -> Any:
    for part in path.split("/"):
        if not isinstance(tree, dict) or part not in tree:
            return None
        tree = tree[part]
    return tree


def run(config: Config, progress=no_progress) -> dict[str, Any]:
    """Per-module loss change and SQNRs, ranked (most sensitive first).

    Returns:
      ``{"reference_loss": ..., "rows": [{"path", "type", "applied", "loss", "loss_delta",
      "rel_loss_delta", "output_sqnr_db", "grad_sqnr_db", "module_grad_sqnr_db"}, ...],
      "ranking": [paths], ...}``; rows in ranking order.
    """
    mcfg = config.train.model_config()
    shape = jax.ShapeDtypeStruct((config.train.batch, config.train.seq_len), jnp.int32)
    mods = candidate_modules(mcfg, shape, config.modules)  # checked before any training
    if not mods:
        raise ValueError(f"modules={config.modules!r} matches no module; paths are "
                         f"{', '.join(candidate_modules(mcfg, shape))}.")
    mcfg, params, tokens = prepare(config, progress)
    jit = config.execution == "jit" or (config.execution == "auto" and len(mods) <= 8)
    ref = evaluate(mcfg, params, tokens, None, "fp32", jit=jit)
    ref_loss = float(ref["loss"])
    value = target_value(config.target)
    is_fp8 = value.fp8 is not None
    rows = []
    for path in progress(list(mods), total=len(mods), desc="modules"):
        kind = mods[path]
        out = evaluate(mcfg, params, tokens, path, config.target, jit=jit)
        own_ref, own = _subtree(ref["grads"], path), _subtree(out["grads"], path)
        # Parameters of the module itself (not of child modules: attention's are its
        # projections, which are rows of their own).
        if isinstance(own_ref, dict):
            own_ref = {k: v for k, v in own_ref.items() if not isinstance(v, dict)}
            own = {k: v for k, v in own.items() if not isinstance(v, dict)}
        if is_fp8:
            applied = (f"fp8 {value.fp8.name}" if kind in _DOT_TYPES
                       else "bf16 (no FP8 matmul here)")
        else:
            applied = str(value)
        loss = float(out["loss"])
        rows.append({
            "path": path, "type": kind, "applied": applied,
            "loss": loss, "loss_delta": loss - ref_loss,
            "rel_loss_delta": (loss - ref_loss) / ref_loss,
            "output_sqnr_db": sqnr_db(ref["logits"], out["logits"]),
            "grad_sqnr_db": sqnr_db(ref["grads"], out["grads"]),
            "module_grad_sqnr_db": sqnr_db(own_ref, own) if own_ref else None,
        })
    key = {"grad_sqnr": lambda r: r["grad_sqnr_db"],
           "output_sqnr": lambda r: r["output_sqnr_db"],
           "loss": lambda r: -abs(r["loss_delta"])}[config.rank_by]
    rows.sort(key=key)
    return {
        "target": config.target,
        "target_policy": str(value),
        "rank_by": config.rank_by,
        "execution": "jit" if jit else "eager",
        "train_steps": config.train_steps,
        "reference_loss": ref_loss,
        "rows": rows,
        "ranking": [r["path"] for r in rows],
        "tokens": int(tokens.size),
    }


def _db(x: float | None) -> str:
    if x is None:
        return "-"
    return "inf" if math.isinf(x) else f"{x:.1f}"


def summarize(results: dict[str, Any]) -> str:
    """The ranked table."""
    rows = [[i + 1, r["path"], r["applied"], f"{r['loss_delta']:+.2e}",
             f"{100 * r['rel_loss_delta']:+.3f}%", _db(r["output_sqnr_db"]),
             _db(r["grad_sqnr_db"]), _db(r["module_grad_sqnr_db"])]
            for i, r in enumerate(results["rows"])]
    return format_table(
        ["#", "module", "lowered to", "loss change", "relative", "logits SQNR dB",
         "grad SQNR dB", "own grads SQNR dB"], rows,
        title=(f"one module at a time in {results['target']} (everything else f32), ranked by "
               f"{results['rank_by']}, most sensitive first; f32 loss "
               f"{results['reference_loss']:.4f} after {results['train_steps']} steps"))


def plot(results: dict[str, Any], out_dir: Path) -> list[Path]:
    """``sensitivity.png``: per-module logits and gradient SQNR (bars, ranked) and the loss
    change."""
    rows = results["rows"]
    cap = 160.0  # where an infinite SQNR (no change) is drawn

    def val(x):
        return cap if x is None or math.isinf(x) else x

    with plot_style():
        fig, (ax1, ax2) = figure(1, 2, width=12.0, height=max(3.0, 0.28 * len(rows) + 1.4))
        y = np.arange(len(rows))
        labels = [r["path"] for r in rows]
        ax1.barh(y - 0.2, [val(r["grad_sqnr_db"]) for r in rows], 0.4, color="#9467bd",
                 label="parameter gradients")
        ax1.barh(y + 0.2, [val(r["output_sqnr_db"]) for r in rows], 0.4, color="#1f77b4",
                 label="logits")
        ax1.set_yticks(y, labels, fontsize=7)
        ax1.invert_yaxis()
        ax1.set_xlabel("SQNR vs all-f32 (dB; higher = less affected)")
        ax1.set_title(f"one module in {results['target']}, the rest f32")
        ax1.legend(fontsize=7)
        ax2.barh(y, [100 * r["rel_loss_delta"] for r in rows], color="#d62728")
        ax2.set_yticks(y, [""] * len(rows))
        ax2.invert_yaxis()
        ax2.axvline(0, color="k", lw=0.8)
        ax2.set_xlabel("loss change (%)")
        ax2.set_title(f"f32 loss {results['reference_loss']:.3f}")
        return [save(fig, out_dir, "sensitivity")]
