"""The ``train`` phase's optimizer step: the studies' optax chain against plain adamw.

The training studies wrap AdamW in ``fmtkit.optim``'s f32 master weights and dynamic loss
scaling (``dynamic_loss_scale(master_weights(adamw))`` on bf16 parameters and loss-scaled
bf16 gradients, as ``fmtkit bench optim`` builds it); the baseline is ``optax.adamw`` on f32
parameters and gradients. Both steps are jitted with parameters and optimizer state donated,
timed interleaved (``time_interleaved``), and their ratio recorded. On a CPU XLA makes one
loop per output array; on a GPU its multi-output fusion can fold the unscale, the finiteness
check, the master update and the rounding into the adamw kernels, so the chain's extra
bytes, not its extra passes, decide what it costs. The compiled steps' fusion counts are
recorded beside the times.
"""

from __future__ import annotations

import re
from typing import Any

from tools.gpu_check.timing import time_interleaved

__all__ = ["OPTIM_ROUNDS", "OPTIM_WIDTH_LAYERS", "OPTIM_WIDTH_LAYERS_REHEARSAL", "optax_chain"]

OPTIM_WIDTH_LAYERS = (4096, 4)  # 67M parameters: adamw moves 28 B each, ~1.9 GB a step
OPTIM_WIDTH_LAYERS_REHEARSAL = (64, 2)
OPTIM_ROUNDS = 30
_LR = 1e-3
_SCALE = 2.0**16  # the loss scale the gradients were computed with (GradScaler's default)


class _Runner:
    """Threads donated ``(params, state)`` through repeated calls of a jitted step."""

    def __init__(self, step, params, state, grads):
        self.step, self.params, self.state, self.grads = step, params, state, grads

    def __call__(self):
        self.params, self.state = self.step(self.params, self.state, self.grads)
        return self.params

    def sync(self, _outputs: Any) -> Any:
        """Waits for the latest step (earlier outputs were donated to the steps after)."""
        import jax

        return jax.block_until_ready(self.params)


def _fusions(hlo_text: str) -> int:
    """Fusion instructions in a compiled HLO module (every computation, branches included)."""
    return len(re.findall(r"= \S+ fusion\(", hlo_text))


def optax_chain(*, rehearsal: bool, rounds: int | None = None) -> dict:
    """Median seconds per step of the studies' optax chain and of plain ``optax.adamw`` on
    the same parameter count, interleaved; their ratio; the compiled steps' fusion counts."""
    import jax
    import jax.numpy as jnp
    import optax

    from fmtkit import optim

    width, layers = OPTIM_WIDTH_LAYERS_REHEARSAL if rehearsal else OPTIM_WIDTH_LAYERS
    rounds = rounds or (2 if rehearsal else OPTIM_ROUNDS)
    keys = jax.random.split(jax.random.key(0), 2 * layers)
    p32 = {f"layer{i}": {"w": 0.02 * jax.random.normal(keys[i], (width, width)),
                         "b": jnp.zeros((width,), jnp.float32)} for i in range(layers)}
    g32 = {name: {"w": 1e-3 * jax.random.normal(keys[layers + i], (width, width)),
                  "b": jnp.full((width,), 1e-3, jnp.float32)}
           for i, name in enumerate(p32)}

    def step_of(opt):
        def step(params, state, grads):
            updates, state = opt.update(grads, state, params)
            return optax.apply_updates(params, updates), state
        return jax.jit(step, donate_argnums=(0, 1))

    adamw = optax.adamw(_LR)
    chain = optim.dynamic_loss_scale(optim.master_weights(adamw))
    with jax.numpy_dtype_promotion("standard"):  # optax mixes f32 schedules and bf16
        pb = jax.tree.map(lambda x: x.astype(jnp.bfloat16), p32)
        gb = jax.tree.map(lambda g: (g * _SCALE).astype(jnp.bfloat16), g32)
        pf = jax.tree.map(jnp.copy, p32)
        runners = {"studies_chain": _Runner(step_of(chain), pb, jax.jit(chain.init)(pb), gb),
                   "optax_adamw": _Runner(step_of(adamw), pf, jax.jit(adamw.init)(pf), g32)}
        fusions = {}
        for name, r in runners.items():  # one compile each: time the compiled step itself
            r.step = r.step.lower(r.params, r.state, r.grads).compile()
            fusions[name] = _fusions(r.step.as_text())
        times = time_interleaved({name: (r, r.sync) for name, r in runners.items()}, rounds,
                                 rehearsal)
    chain_t, plain_t = times["studies_chain"], times["optax_adamw"]
    return {"ok": True, "params": int(optax.tree.size(p32)), "width": width, "layers": layers,
            "chain": "dynamic_loss_scale(master_weights(optax.adamw(1e-3))), bf16 params, "
                     "loss-scaled bf16 gradients",
            "baseline": "optax.adamw(1e-3), f32 params and gradients",
            "backend": jax.default_backend(), "impls": times, "hlo_fusions": fusions,
            "ratio_median": chain_t["median_s"] / plain_t["median_s"],
            "ratio_min": chain_t["min_s"] / plain_t["min_s"],
            "timing": "host, interleaved batches, donated state"}
