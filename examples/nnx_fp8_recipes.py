"""FP8 recipes on a Flax NNX model, delayed scaling's state included.

The same NNX MLP trained under bf16-mixed and under several FP8 presets (FP8 on every
projection matmul in forward, data gradient and weight gradient; the head in bf16). Delayed
scaling keeps an amax history per matmul: the policied model holds it in NNX Variables
created by its first call; the training step differentiates the loss with respect to them
too (their "gradient" is what the matmuls observed) and records it once per step.

Run: python examples/nnx_fp8_recipes.py   (about 30 s on a 2-core CPU)
"""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_allow_excess_precision=false").strip()

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import fmtkit
from fmtkit import fp8, with_policy

# The NNX Variable type that holds a policied model's delayed FP8 states (amax histories).
Delayed = fmtkit.policy.DelayedScalingVariable


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.fc1 = nnx.Linear(64, 256, rngs=rngs)
        self.fc2 = nnx.Linear(256, 256, rngs=rngs)
        self.out = nnx.Linear(256, 1, rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.gelu(self.fc2(nnx.gelu(self.fc1(x)))))


def make_data(key, n=2048, d=64):
    kx, kw = jax.random.split(key)
    x = jax.random.normal(kx, (n, d))
    y = jnp.sin(x @ jax.random.normal(kw, (d, 1)) / d**0.5)
    return x, y


def train(preset: str, steps: int = 150) -> str:
    x, y = make_data(jax.random.key(0))
    model = with_policy(MLP(nnx.Rngs(0)), preset)
    delayed = fp8.get_recipe(preset.removeprefix("fp8-")).delayed if preset.startswith(
        "fp8-") else False
    if delayed:
        model(x[:1])  # creates the amax histories, outside the jitted step
    optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    wrt = (nnx.Param, Delayed) if delayed else nnx.Param

    @nnx.jit
    def step(model, optimizer, bx, by):
        loss_fn = lambda m: jnp.mean((m(bx).astype(jnp.float32) - by) ** 2)  # noqa: E731
        loss, grads = nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, wrt))(model)
        if delayed:
            grads, observed = nnx.split_state(grads, nnx.Param, Delayed)
            nnx.update(model, fp8.update_state(nnx.state(model, Delayed), observed))
        optimizer.update(model, grads)
        return loss

    for i in range(steps):
        rows = slice((i * 256) % 2048, (i * 256) % 2048 + 256)
        loss = step(model, optimizer, x[rows], y[rows])
    line = f"{preset:14s} final loss {float(loss):.5f}"
    if delayed:
        history = jax.tree.leaves(nnx.state(model, Delayed))[0]   # [3, history]: x, w, grad
        line += f"  (fc1's newest amaxes x, w, grad: {[f'{v:.3g}' for v in history[:, 0]]})"
    return line


for preset in ("bf16-mixed", "fp8-current", "fp8-delayed", "fp8-rowwise", "fp8-blockwise"):
    print(train(preset))
