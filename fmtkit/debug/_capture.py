"""Capturing the statistics of the GEMMs a policied call runs, and applying the overrides.

``capture(config, stats_state, step)`` installs a hook on the policy's GEMMs
(``fmtkit.policy.intercept_gemms``). For each GEMM a rule matches:

* the override changes how ``run`` computes it (no recipe, a per-tensor current or a
  blockwise recipe, or quantize-dequantize around the compute-dtype GEMM);
* the forward tensors' statistics are computed in the forward pass and the backward tensors'
  in the backward pass, each under ``lax.cond`` on the rule's schedule (NaN on other steps).
  They leave the step as the *gradient* of ``stats_state``: identity functions with a custom
  VJP take the state's leaves as an input and return the statistics as their cotangent (as
  a delayed FP8 recipe's amax history returns the observed amaxes). So a training step that
  differentiates its loss with respect to ``(params, stats_state)`` gets the statistics
  exactly, with no extra output and no change to the model.

``init(config, fn, *args)`` traces ``fn`` abstractly to find the GEMMs and returns the
zero-valued state (the pytree the statistics fill), raising on a rule that matches none.

A GEMM that did not run (the branch of ``lax.cond`` not taken) gets NaN, no data, not the 0
its taps' missing cotangent would be (``_gate``). So does a GEMM inside a user's
``jax.custom_vjp`` / ``jax.custom_jvp`` (``GemmSite.in_custom_rule``): its derivative is the
user's rule, which a tap's VJP cannot join (it is not tapped, with a warning).

A GEMM in a scan body (a scanned layer stack) has state leaves shaped by the trip counts of
the scans around it (``GemmSite.loop_lengths``); the policy hands the GEMM the iteration
index (``GemmSite.loop_index``), and the taps return the statistics at that iteration's
slot and 0 elsewhere (``_in_slot``): the state is a value the scan body closes over, whose
cotangent the scan's transpose adds up over the iterations, which stacks the slots.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from fmtkit._switches import SWITCHES
from fmtkit.debug._config import (
    BASE_STATS,
    QUANT_STATS,
    QUANTIZED_TENSORS,
    DebugConfig,
    parse_override,
)
from fmtkit.fp4 import Fp4Recipe
from fmtkit.fp8 import RECIPES, Fp8Recipe
from fmtkit.policy import GemmSite, intercept_gemms
from fmtkit.scaling import TensorScaling, qdq
from fmtkit.stats import Quantization, quant_stats, tensor_stats

__all__ = ["capture", "init"]

_FWD = ("activation", "weight", "output")


@dataclasses.dataclass
class _Plan:
    """What one GEMM does under the configuration."""

    rule: int
    recipe: Any  # the recipe run() gets
    fake: str | None  # fake_quant format
    quant: dict[str, Quantization]  # tensor -> how it is quantized
    stats: dict[str, tuple[str, ...]]  # tensor -> statistics to log
    experts: int | None = None  # a grouped GEMM's group count: statistics per expert

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of one statistic of one step (one iteration): () or (experts,)."""
        return () if self.experts is None else (self.experts,)


def _current(recipe: Any) -> Fp8Recipe:
    """Per-tensor current scaling with the formats of ``recipe`` (E4M3/E5M2 without one)."""
    base = Fp8Recipe("current")
    if recipe is None:
        return base
    return Fp8Recipe("current", x_format=recipe.x_format, w_format=recipe.w_format,
                     grad_format=recipe.grad_format)


def _blockwise(recipe: Any) -> Fp8Recipe:
    """Fine-grained scaling (DeepSeek-V3's 1x128 activation and gradient tiles, 128x128
    weight blocks: the named "blockwise" recipe) with the formats of ``recipe`` (the named
    recipe's E4M3 throughout without one)."""
    base = RECIPES["blockwise"]
    if recipe is None:
        return base
    return dataclasses.replace(base, x_format=recipe.x_format, w_format=recipe.w_format,
                               grad_format=recipe.grad_format)


def _quantizations(recipe: Any, fake: str | None, history: Any
                   ) -> dict[str, Quantization]:
    """How the GEMM quantizes each operand: the fake format per tensor, or the recipe's
    format and tiling (recipes whose quantization has a ``fmtkit.scaling`` equivalent, with
    a delayed recipe's scales from its amax history ``history``; not FP4's two-level
    scales)."""
    if fake is not None:
        return {t: Quantization(fake, TensorScaling()) for t in QUANTIZED_TENSORS}
    if recipe is None or isinstance(recipe, Fp4Recipe):
        return {}
    if recipe.delayed:
        if history is None:
            return {}
        scaling = TensorScaling(recipe.power_of_two, recipe.margin)
        return {t: Quantization(fmt, scaling, i, recipe.amax_algo)
                for i, (t, fmt) in enumerate((("activation", recipe.x_format),
                                              ("weight", recipe.w_format),
                                              ("output_grad", recipe.grad_format)))}
    return {"activation": Quantization(recipe.x_format, recipe.scaling("x")),
            "weight": Quantization(recipe.w_format, recipe.scaling("w")),
            "output_grad": Quantization(recipe.grad_format, recipe.scaling("grad"))}


def _plan(config: DebugConfig, site: GemmSite) -> _Plan | None:
    i = config.rule_index(site.path, site.name, site.type_names, site.ancestors)
    if i is None:
        return None
    rule = config.rules[i]
    override = parse_override(rule.override)
    recipe, fake = site.fp8, None
    if override is not None:
        kind, fmt = override
        if kind == "compute":
            recipe = None
        elif kind in ("current", "blockwise"):
            make = _current if kind == "current" else _blockwise
            recipe = make(site.fp8) if site.fp8_capable else None
        else:
            recipe, fake = None, fmt
    # (quantization statistics replay a dot_general's or lax.ragged_dot's operand layout;
    # none for convolutions)
    history = site.fp8_history if recipe is site.fp8 else None
    experts = None
    quant = {}
    if site.group_sizes is not None:
        experts = int(site.group_sizes.shape[0])
        # (the grouped GEMM runs a delayed recipe as current scaling: fmtkit.fp8.ragged_dot)
        if isinstance(recipe, Fp8Recipe) and recipe.delayed:
            quant = _quantizations(dataclasses.replace(recipe, delayed=False), fake, None)
        else:
            quant = _quantizations(recipe, fake, None)
    elif site.dimension_numbers is not None:
        quant = _quantizations(recipe, fake, history)
    stats = {}
    for t in rule.tensors:
        allowed = BASE_STATS + (QUANT_STATS if t in quant else ())
        stats[t] = tuple(s for s in rule.stats if s in allowed)
    return _Plan(i, recipe, fake, quant, stats, experts)


# -- canonical layouts ----------------------------------------------------------------------
def _dims(site: GemmSite, lhs, rhs):
    """(lhs batch, lhs free, lhs contracting, rhs batch, rhs free, rhs contracting) dims."""
    (lc, rc), (lb, rb) = site.dimension_numbers
    lc, rc, lb, rb = (tuple(int(d) % a.ndim for d in ds)
                      for ds, a in ((lc, lhs), (rc, rhs), (lb, lhs), (rb, rhs)))
    lf = tuple(d for d in range(lhs.ndim) if d not in lc and d not in lb)
    rf = tuple(d for d in range(rhs.ndim) if d not in rc and d not in rb)
    return lb, lf, lc, rb, rf, rc


def _as3(x, batch, free, contract):
    """``x`` transposed and reshaped to ``[B, F, C]``."""
    b = math.prod(x.shape[d] for d in batch)
    f = math.prod(x.shape[d] for d in free)
    c = math.prod(x.shape[d] for d in contract)
    return x.transpose(*batch, *free, *contract).reshape(b, f, c)


def _canonical(site: GemmSite, tensor: str, x, lhs_shape, rhs_shape):
    """An operand as its GEMM quantizes it, ``[B, free, contraction]``: the activation
    contracting K, the weight ``[N, K]``, the output gradient ``[M, N]`` contracting N (its
    data-gradient GEMM). The weight is the operand ``site.weight_operand`` names (the left
    one for Equinox's ``weight @ x``), as the FP8 GEMM takes it."""
    lhs = jax.ShapeDtypeStruct(lhs_shape, x.dtype)
    rhs = jax.ShapeDtypeStruct(rhs_shape, x.dtype)
    lb, lf, lc, rb, rf, rc = _dims(site, lhs, rhs)
    act, weight = (lb, lf, lc), (rb, rf, rc)
    if site.weight_operand == 0:
        act, weight = weight, act
    if tensor == "activation":
        return _as3(x, *act)
    if tensor == "weight":
        return _as3(x, *weight) if SWITCHES.debug_weight_as_read else x.reshape(1, *x.shape)
    # The output is laid out [batch, lhs free, rhs free]; M is the activation's free axes.
    nb = len(lb)
    lhs_free = tuple(range(nb, nb + len(lf)))
    rhs_free = tuple(range(nb + len(lf), x.ndim))
    m, n = (rhs_free, lhs_free) if site.weight_operand == 0 else (lhs_free, rhs_free)
    return _as3(x, tuple(range(nb)), m, n)


# -- the grouped GEMM (lax.ragged_dot): statistics per expert --------------------------------
_ROWS = ("activation", "output", "output_grad", "dgrad")  # [M, .], rows sorted by expert


def _group_ids(group_sizes: jax.Array, m: int) -> jax.Array:
    """The expert of each of ``m`` sorted rows (rows past the last group: ``G``, none)."""
    ends = jnp.cumsum(group_sizes.astype(jnp.int32))
    return jnp.sum(jnp.arange(m, dtype=jnp.int32)[:, None] >= ends[None, :], axis=1)


def _expert_rows(tensor: str, x, gid, g: int):
    """The segments of ``tensor_stats``: the expert of each row of ``x`` as ``[rows,
    last]``: the sorted token rows of the row tensors; K rows per expert of the stacks
    ``[G, K, N]`` (weight, wgrad)."""
    if tensor in _ROWS:
        return gid, g
    return jnp.repeat(jnp.arange(g, dtype=jnp.int32), x.shape[1]), g


def _expert_operand(plan: _Plan, tensor: str, x, gid, g: int):
    """(the operand as the grouped GEMM quantizes it, ``[B, free, contraction]``, and the
    expert of each ``[B, free]`` row): the activation ``[1, M, K]`` and the output gradient
    ``[1, M, N]`` (the data-gradient GEMM's), one quantization for all tokens; the weight
    stack as ``[G, N, K]``, one quantization per expert (``[1, G*N, K]`` under a fake
    quantization, which quantizes the stack as one tensor)."""
    if tensor in _ROWS:
        return x[None], (gid[None], g)
    w = jnp.swapaxes(x, 1, 2)  # [G, N, K]
    n = w.shape[1]
    ids = jnp.broadcast_to(jnp.arange(g, dtype=jnp.int32)[:, None], (g, n))
    if plan.fake is not None:
        return w.reshape(1, g * n, -1), (ids.reshape(1, -1), g)
    return w, (ids, g)


def _compute(plan: _Plan, site: GemmSite, tensors: Mapping[str, jax.Array], shapes,
             history: Any = None, gid: Any = None) -> dict[str, dict[str, jax.Array]]:
    out = {}
    for t, x in tensors.items():
        stats = plan.stats[t]
        quant = t in plan.quant and any(s in QUANT_STATS for s in stats)
        if plan.experts is None:
            d = tensor_stats(x, stats)
            if quant:
                d.update(quant_stats(_canonical(site, t, x, *shapes), plan.quant[t], stats,
                                     history))
        else:
            d = tensor_stats(x, stats, _expert_rows(t, x, gid, plan.experts))
            if quant:
                x3, seg = _expert_operand(plan, t, x, gid, plan.experts)
                d.update(quant_stats(x3, plan.quant[t], stats, segments=seg))
        out[t] = {s: d[s] for s in stats}
    return out


def _nans(like, shape=()):
    return jax.tree.map(lambda _: jnp.full(shape, jnp.nan, jnp.float32), like)


def _cond_stats(static_on, on, fn, like, *xs, shape=()):
    """``fn(*xs)`` on logging steps, NaN elsewhere: decided while tracing where the step's
    schedule is known (``static_on``, a bool: the other branch is not traced at all), else
    at run time by ``lax.cond`` on ``on``. Each statistic has ``shape`` (``(experts,)``
    for a grouped GEMM)."""
    if static_on is True:
        return fn(*xs)
    if static_on is False:
        return _nans(like, shape)
    # The branches return the statistics packed in one f32 vector, unpacked after the cond:
    # a cond returning each scalar as its own output costs a copy per statistic on every
    # quiet step (a few thousand in a transformer's step).
    leaves, treedef = jax.tree.flatten(like)
    if not leaves:
        return like

    def packed(*args):
        return jnp.stack([jnp.asarray(v, jnp.float32).reshape(shape)
                          for v in treedef.flatten_up_to(fn(*args))])

    vec = lax.cond(on, packed,
                   lambda *_: jnp.full((len(leaves), *shape), jnp.nan, jnp.float32), *xs)
    return jax.tree.unflatten(treedef, list(vec))


# -- loop bodies: one slot of the state per iteration --------------------------------------
def _check_loops(pattern: str, site: GemmSite, leaves: Any, per_step: tuple = ()) -> None:
    """Statistics of a GEMM in a loop need every loop's trip count (a scan's, not a
    ``while`` loop's), and its state leaves shaped by them (then by ``per_step``, the
    experts of a grouped GEMM)."""
    if any(n is None for n in site.loop_lengths):
        raise ValueError(
            f"fmtkit.debug: the rule {pattern!r} logs statistics of GEMM {site.path!r}/"
            f"{site.name}, which runs inside a while loop (lax.while_loop, or lax.fori_loop "
            "with a bound known only at run time): its trip count is unknown, so its "
            "iterations have no slots in the statistics (and a while loop is not "
            "reverse-differentiable). Give the loop static bounds (fori_loop with Python int "
            "bounds becomes a scan) or write it with lax.scan / nn.scan, or give this rule "
            "tensors=() to keep only its override.")
    shapes = {tuple(jnp.shape(x)) for x in jax.tree.leaves(leaves)}
    want = (*site.loop_lengths, *per_step)
    if shapes and shapes != {want}:
        why = (f"runs in loops of trip counts {tuple(site.loop_lengths)} (one slot per "
               "iteration)" if site.loop_lengths else "runs outside loops")
        if per_step:
            why += f" and has {per_step[0]} experts (one value each)"
        raise ValueError(
            f"fmtkit.debug.capture: the stats_state entry of GEMM {site.path!r}/{site.name} "
            f"has shape {sorted(shapes)[0]}, but the GEMM {why}: make the state with "
            "fmtkit.debug.init from the same configuration, function and argument shapes.")


def _slot_mask(site: GemmSite):
    """bool[*loop_lengths], true at the current iteration of each loop around the GEMM; None
    outside loops."""
    if not site.loop_lengths:
        return None
    mask = jnp.ones((), bool)
    for i, n in zip(site.loop_index, site.loop_lengths):
        hit = jnp.arange(n, dtype=jnp.int32) == i
        mask = mask[..., None] & hit.reshape((1,) * mask.ndim + (n,))
    return mask if SWITCHES.debug_loop_slots else jnp.zeros_like(mask).at[0].set(True)


def _in_slot(stats, slot):
    """The statistics (scalars) as the cotangent of the state's leaves: in a loop body, at the
    current iteration's slot and 0 elsewhere, so that the loop's transpose, which sums the
    cotangent of a closed-over value over the iterations, stacks them (a NaN stays in its
    slot: ``where``, not a product)."""
    if slot is None:
        return stats
    zero = jnp.zeros((), jnp.float32)
    return jax.tree.map(lambda s: jnp.where(slot.reshape(slot.shape + (1,) * jnp.ndim(s)),
                                            s.astype(jnp.float32), zero), stats)


# -- taps: identities whose cotangent for the state's leaves is the statistics ---------------
def _grad_tap(plan, site, tensor, shapes, static_on):
    """``x -> x``; its backward returns (stats of the cotangent of x, ...)."""

    @jax.custom_vjp
    def tap(leaves, on, slot, gid, x):
        return x

    def fwd(leaves, on, slot, gid, x):
        return x, (on, slot, gid, leaves)

    def bwd(res, g):
        on, slot, gid, leaves = res
        stats = _cond_stats(
            static_on, on,
            lambda gg, i: _compute(plan, site, {tensor: gg}, shapes, gid=i)[tensor],
            leaves, g, gid, shape=plan.shape)
        return _in_slot(stats, slot), None, None, None, g

    tap.defvjp(fwd, bwd)
    return tap


def _out_tap(plan, site, shapes, fwd_tensors, grad_logged, static_on):
    """``y -> y`` with the forward tensors' statistics computed in its forward pass and
    the output gradient's in its backward; both returned as the state leaves' cotangent."""

    @jax.custom_vjp
    def tap(leaves, on, slot, hist, gid, act, weight, y):
        return y

    def fwd(leaves, on, slot, hist, gid, act, weight, y):
        vals = {"activation": act, "weight": weight, "output": y}
        like = {t: leaves[t] for t in fwd_tensors}

        def compute(h, i, *xs):
            return _compute(plan, site, dict(zip(fwd_tensors, xs)), shapes, h, i)

        stats = _cond_stats(static_on, on, compute, like, hist, gid,
                            *(vals[t] for t in fwd_tensors), shape=plan.shape)
        return y, (on, slot, hist, gid, stats, leaves.get("output_grad"))

    def bwd(res, g):
        on, slot, hist, gid, stats, g_like = res
        stats = dict(stats)
        if grad_logged:
            def compute(h, i, gg):
                return _compute(plan, site, {"output_grad": gg}, shapes, h,
                                i)["output_grad"]

            stats["output_grad"] = _cond_stats(static_on, on, compute, g_like, hist, gid, g,
                                               shape=plan.shape)
        return _in_slot(stats, slot), None, None, None, None, None, None, g

    tap.defvjp(fwd, bwd)
    return tap


# -- "no data": a GEMM that did not run this step --------------------------------------------
# A tap's cotangent is 0 wherever its backward does not run: in the branch of lax.cond a step
# does not take (the cond's transpose runs the taken branch only), or where the GEMM's output
# reaches no loss. ``_gate`` tells that 0 from a statistic: at the capture's entry it passes
# the state through beside a "ran" tree of zeros of the same structure, whose cotangent
# ``_mark`` sets to 1 for the GEMM's leaves (in the iteration's slot) where the GEMM ran; the
# gate's backward turns each statistic whose mark stayed 0 into NaN, the "no data" of a step
# that does not log.
@jax.custom_vjp
def _gate(state, ran):
    return state, ran


def _gate_fwd(state, ran):
    return (state, ran), None


def _gate_bwd(_, cts):
    ct_state, ct_ran = cts
    nan = jnp.full((), jnp.nan, jnp.float32)
    return (jax.tree.map(lambda c, r: jnp.where(r > 0, c, nan), ct_state, ct_ran),
            jax.tree.map(jnp.zeros_like, ct_ran))


_gate.defvjp(_gate_fwd, _gate_bwd)


@jax.custom_vjp
def _mark(ran, slot, y):
    """``y -> y``; its backward marks the GEMM as run: cotangent 1 for each leaf of its
    ``ran`` entry (at the iteration's slot)."""
    return y


def _mark_fwd(ran, slot, y):
    return y, (slot, ran)


def _mark_bwd(res, g):
    slot, ran = res
    loops = 0 if slot is None else slot.ndim
    ones = jax.tree.map(lambda r: jnp.ones(jnp.shape(r)[loops:], jnp.float32), ran)
    return _in_slot(ones, slot), None, g


_mark.defvjp(_mark_fwd, _mark_bwd)


def _identity(y, fmt):
    return y


# y -> y whose cotangent is quantized and dequantized to ``fmt`` (per-tensor current
# scaling): the output gradient of a fake-quantized GEMM.
_qdq_grad = jax.custom_vjp(_identity, nondiff_argnums=(1,))
_qdq_grad.defvjp(lambda y, fmt: (y, None),
                 lambda fmt, _, g: (qdq(g, fmt, TensorScaling()),))


# -- the session ----------------------------------------------------------------------------
class _Session:
    def __init__(self, config: DebugConfig, state: Any, step: Any, discover: bool,
                 active: frozenset[int] | None = None):
        self.config = config
        self.state = state
        self.step = step
        self.active = active
        self.discover = discover
        self.ran: dict = {}  # GEMM -> its "ran" leaf (``_gate``)
        self.sites: dict[tuple[str, str], tuple[GemmSite, _Plan | None]] = {}

    def __call__(self, site: GemmSite, run: Callable, lhs, rhs):
        plan = _plan(self.config, site)
        seen = self.sites.get((site.path, site.name))
        if plan is not None and seen is not None and seen[0].call != site.call:
            raise ValueError(
                f"fmtkit.debug: GEMM {site.path!r}/{site.name} ran in two policied calls "
                "inside one capture (the model applied twice): their statistics would share "
                "one entry. Capture one call, or keep the second call out of the capture.")
        self.sites[(site.path, site.name)] = (site, plan)
        if plan is None:
            return run(lhs, rhs, site.fp8)
        logged = {t: s for t, s in plan.stats.items() if s}
        leaves = None
        if logged and not self.discover and self.state is not None:
            leaves = self.state.get(site.path, {}).get(site.name)
            if leaves is None:
                raise ValueError(
                    f"fmtkit.debug.capture: GEMM {site.path!r}/{site.name} logs statistics "
                    "but has no entry in stats_state: make the state with fmtkit.debug.init "
                    "from the same configuration, function and argument shapes.")
        if logged:
            _check_loops(self.config.rules[plan.rule].pattern, site, leaves, plan.shape)
        if leaves is not None and site.in_custom_rule:
            warnings.warn(
                f"fmtkit.debug: GEMM {site.path!r}/{site.name} runs inside a jax.custom_vjp "
                "or jax.custom_jvp (its derivative is the user's rule, not JAX's), so its "
                "statistics cannot leave the step: they are NaN (no data). Its override "
                "applies.", stacklevel=2)
            leaves = None
        if leaves is None:
            return self._run(plan, run, lhs, rhs)
        if self.active is not None:
            static_on, on = plan.rule in self.active, jnp.asarray(False)
        else:
            static_on, on = None, self.config.rules[plan.rule].logs_at(self.step)
        shapes = (lhs.shape, rhs.shape)
        slot = _slot_mask(site)
        gid = None if plan.experts is None else _group_ids(site.group_sizes, lhs.shape[0])
        # (the activation and the weight by role: site.weight_operand is 0 where the weight
        # is the left operand, Equinox's weight @ x; a grouped GEMM's weight is its stack)
        left = site.weight_operand == 0 and site.group_sizes is None
        act, weight = (rhs, lhs) if left else (lhs, rhs)
        a, b = act, weight
        if "dgrad" in leaves:
            a = _grad_tap(plan, site, "dgrad", shapes, static_on)(leaves["dgrad"], on, slot,
                                                                  gid, a)
        if "wgrad" in leaves:
            b = _grad_tap(plan, site, "wgrad", shapes, static_on)(leaves["wgrad"], on, slot,
                                                                  gid, b)
        if left:
            a, b = b, a
        y = self._run(plan, run, a, b)
        fwd_tensors = tuple(t for t in _FWD if t in leaves)
        grad_logged = "output_grad" in leaves
        if fwd_tensors or grad_logged:
            sub = {t: leaves[t] for t in (*fwd_tensors, "output_grad") if t in leaves}
            hist = None
            if site.fp8_history is not None and any(q.row is not None
                                                    for q in plan.quant.values()):
                hist = jnp.asarray(site.fp8_history, jnp.float32)
                hist = lax.stop_gradient(hist.reshape(-1, *hist.shape[-2:]))  # [B, 3, H]
            y = _out_tap(plan, site, shapes, fwd_tensors, grad_logged, static_on)(
                sub, on, slot, hist, gid, lax.stop_gradient(act), lax.stop_gradient(weight), y)
        ran = self.ran.get(site.path, {}).get(site.name)
        if ran is not None:
            y = _mark(ran, slot, y)
        return y

    @staticmethod
    def _run(plan: _Plan, run: Callable, lhs, rhs):
        if plan.fake is None:
            return run(lhs, rhs, plan.recipe)
        q = TensorScaling()
        y = run(qdq(lhs, plan.fake, q), qdq(rhs, plan.fake, q), None)
        return _qdq_grad(y, plan.fake)

    def check_matched(self) -> None:
        """Every rule must match at least one GEMM seen (when any was seen)."""
        if not self.sites:
            return
        used = {plan.rule for _, plan in self.sites.values() if plan is not None}
        for i, rule in enumerate(self.config.rules):
            if i not in used:
                matched_earlier = [
                    f"{p}/{n}" for (p, n), (site, plan) in self.sites.items()
                    if self.config.rules[i:i + 1] and _matches_rule(self.config, i, site)]
                listing = "\n".join(f"  {p!r} / {n}" for p, n in sorted(self.sites))
                why = (f" (it matches {matched_earlier}, which earlier rules take)"
                       if matched_earlier else "")
                raise ValueError(
                    f"fmtkit.debug: rule {i} (pattern {rule.pattern!r}"
                    f"{'' if rule.gemm is None else f', gemm {rule.gemm!r}'}) matches no GEMM"
                    f"{why}. The GEMMs of this call (module path / GEMM) are:\n{listing}")

    def state_tree(self) -> dict:
        tree: dict = {}
        for (path, name), (site, plan) in self.sites.items():
            if plan is None:
                continue
            shape = (*site.loop_lengths, *plan.shape)
            entry = {t: {s: jnp.zeros(shape, jnp.float32) for s in stats}
                     for t, stats in plan.stats.items() if stats}
            if entry:
                tree.setdefault(path, {})[name] = entry
        return tree


def _matches_rule(config: DebugConfig, i: int, site: GemmSite) -> bool:
    sub = DebugConfig(config.rules[i:i + 1])
    return sub.rule_index(site.path, site.name, site.type_names, site.ancestors) is not None


def init(config: DebugConfig, fn: Callable, *args: Any, **kwargs: Any) -> dict:
    """The statistics state of ``fn(*args, **kwargs)`` under ``config``: zeros with the
    structure of the statistics, ``{module_path: {gemm: {tensor: {stat: f32[]}}}}``; a GEMM
    in a scan body has ``f32[L]`` leaves, one slot per iteration (``f32[L1, L2]`` for nested
    scans).

    ``fn`` is the function whose GEMMs are logged, called as the training step calls it (a
    loss of a policied model, or the policied model itself); it is traced abstractly
    (``jax.eval_shape``), nothing runs.

    Raises:
      ValueError: a rule matches no GEMM (the message names the pattern and lists the
        GEMMs), or a logged GEMM runs inside a ``while_loop`` (no static trip count).
      TypeError: ``config`` is not a ``DebugConfig``.

    Example:
      >>> from fmtkit import with_policy
      >>> from fmtkit.debug import DebugConfig, Rule
      >>> model = with_policy(lambda w, x: x @ w, "fp8-current")
      >>> w, x = jnp.ones((16, 8)), jnp.full((4, 16), 0.5)
      >>> loss = lambda w: jnp.sum(model(w, x).astype(jnp.float32))
      >>> cfg = DebugConfig([Rule("", tensors=("activation",), stats=("amax",))])
      >>> init(cfg, loss, w)        # a function's GEMMs sit at the module path ""
      {'': {'dot_general_0': {'activation': {'amax': Array(0., dtype=float32)}}}}
    """
    _check_config(config)
    session = _Session(config, None, 0, discover=True)
    with intercept_gemms(session):
        jax.eval_shape(lambda a, k: fn(*a, **k), args, kwargs)
    session.check_matched()
    return session.state_tree()


def _check_config(config: Any) -> None:
    if not isinstance(config, DebugConfig):
        raise TypeError(f"config must be a fmtkit.debug.DebugConfig, got "
                        f"{type(config).__name__}.")


@contextlib.contextmanager
def capture(config: DebugConfig, stats_state: Mapping | None = None,
            step: jax.typing.ArrayLike | None = None, *,
            active: frozenset[int] | None = None) -> Iterator[None]:
    """Applies ``config`` to the policied calls made inside the block.

    Enter it inside the function you differentiate (the loss), around the policied model's
    call. With ``stats_state`` (from ``init``), the gradient of the loss with respect to
    ``stats_state`` is the statistics of this step (NaN for every statistic whose rule does
    not log at this step). Which rules log is given by one of:

    * ``step``: the step index, an int array that may be traced. One compiled step serves
      every step: each GEMM's statistics are computed under ``lax.cond`` on its rule's
      schedule. The other steps skip the statistics but keep the branches (some cost).
    * ``active``: ``config.active_rules(step)`` computed outside ``jax.jit`` and passed as a
      static argument: the rules that log this step. The compiled step of a quiet step (no
      rule active) has no statistics in it at all, so at most one extra program is compiled
      per distinct set (two with one schedule), and quiet steps cost what the step costs
      without ``fmtkit.debug``.

    Without ``stats_state`` only the overrides apply. A GEMM in a scan body writes each
    iteration's statistics to its own slot of its ``f32[L]`` leaves (NaN in every slot on a
    step that does not log).

    Raises:
      ValueError: ``stats_state`` with neither or both of ``step`` and ``active``; a rule
        that matches none of the GEMMs the block ran; a logged GEMM inside a
        ``while_loop``, or a state entry whose shape is not the loops' trip counts.

    Example:
      >>> from fmtkit import with_policy
      >>> from fmtkit.debug import DebugConfig, Rule
      >>> model = with_policy(lambda w, x: x @ w, "fp8-current")
      >>> w, x = jnp.ones((16, 8)), jnp.full((4, 16), 0.5)
      >>> loss = lambda w: jnp.sum(model(w, x).astype(jnp.float32))
      >>> cfg = DebugConfig([Rule("", tensors=("activation", "output_grad"), stats=("amax",))])
      >>> state = init(cfg, loss, w)
      >>> def f(w, s):
      ...     with capture(cfg, s, step=0):    # the statistics come back as the state's gradient
      ...         return loss(w)
      >>> grads, stats = jax.grad(f, argnums=(0, 1))(w, state)
      >>> {t: float(v["amax"]) for t, v in stats[""]["dot_general_0"].items()}
      {'activation': 0.5, 'output_grad': 1.0}
    """
    _check_config(config)
    if stats_state is not None and (step is None) == (active is None):
        raise ValueError("capture: with stats_state pass exactly one of step= (the step "
                         "index, may be traced) and active= (config.active_rules(step)); "
                         "they decide which rules log this step.")
    if stats_state is not None and not isinstance(stats_state, Mapping):
        raise TypeError("stats_state must be the dict fmtkit.debug.init returns, got "
                        f"{type(stats_state).__name__}.")
    if active is not None:
        if not isinstance(active, frozenset) or not all(
                isinstance(i, int) and 0 <= i < len(config.rules) for i in active):
            raise TypeError("active must be the frozenset of rule indices "
                            f"config.active_rules(step) returns, got {active!r}.")
    session = _Session(config, stats_state, step, discover=False, active=active)
    if stats_state is not None:
        zeros = jax.tree.map(lambda x: jnp.zeros(jnp.shape(x), jnp.float32), stats_state)
        session.state, session.ran = _gate(stats_state, zeros)
    with intercept_gemms(session):
        yield
    session.check_matched()
