"""bf16 training of an unmodified Flax linen model: a precision policy, dynamic loss scaling
and f32 master weights.

Two setups of the same model side by side, against f32:
  bf16-mixed  f32 parameters, bf16 matmuls, f32 softmax / norms / loss (the policy alone);
  pure-bf16   parameters stored in bf16 too, with `optim.master_weights` keeping an exact
              f32 copy (the parameters always equal the master rounded to bf16) and
              `optim.dynamic_loss_scale` skipping any step whose gradients overflow.

Run: python examples/linen_bf16_mixed.py   (about 20 s on a 2-core CPU)
"""

import os

# Keep bf16 intermediates in bf16 inside jit (what the fmtkit CLI sets): XLA would otherwise
# compute some of them in f32 and hide the rounding being studied.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_allow_excess_precision=false").strip()

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from fmtkit import inspect_policy, optim, with_policy


class Classifier(nn.Module):
    """A small MLP classifier, written as anyone writes one: no dtypes anywhere."""

    @nn.compact
    def __call__(self, x):
        x = nn.gelu(nn.Dense(128)(nn.LayerNorm()(x)))
        x = nn.gelu(nn.Dense(128)(x))
        return nn.Dense(10, name="logits")(x)


def make_data(key, n=1024, d=32):
    """Gaussian inputs labelled by a random linear teacher (learnable, not trivially)."""
    kx, kw = jax.random.split(key)
    x = jax.random.normal(kx, (n, d))
    labels = jnp.argmax(x @ jax.random.normal(kw, (d, 10)), axis=-1)
    return x, labels


def train(preset: str, steps: int = 200):
    model = Classifier() if preset == "fp32" else with_policy(Classifier(), preset)
    x, labels = make_data(jax.random.key(0))
    params = model.init(jax.random.key(1), x[:1])["params"]
    optimizer = optax.adamw(3e-3)
    if preset == "pure-bf16":            # bf16 parameters: keep an exact f32 master copy
        optimizer = optim.master_weights(optimizer)
    optimizer = optim.dynamic_loss_scale(optimizer)   # unscales in f32, skips overflows
    state = optimizer.init(params)

    @jax.jit
    def step(params, state, batch_x, batch_y):
        def scaled_loss(p):
            logits = model.apply({"params": p}, batch_x).astype(jnp.float32)
            loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch_y).mean()
            return optim.scale_loss(loss, state), loss     # differentiate the scaled loss

        (_, loss), grads = jax.value_and_grad(scaled_loss, has_aux=True)(params)
        updates, state = optimizer.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    for i in range(steps):
        rows = slice((i * 128) % 1024, (i * 128) % 1024 + 128)
        params, state, loss = step(params, state, x[rows], labels[rows])
    dtypes = sorted({str(p.dtype) for p in jax.tree.leaves(params)})
    line = (f"{preset:10s} loss {float(loss):.5f}  params {','.join(dtypes)}  "
            f"loss scale {float(optim.loss_scale(state)):g}  "
            f"skipped {int(state.skipped_steps)}")
    if preset == "pure-bf16":   # the bf16 params sit exactly on round(master)
        line += f"  off-master {int(optim.param_mismatches(params, state))}"
    print(line)
    return model, x


models = {preset: train(preset) for preset in ("fp32", "bf16-mixed", "pure-bf16")}

# What each module of the bf16-mixed model computed in: bf16 matmul operands, f32 norm
# statistics, the head ("logits") on bf16 operands with f32 output, f32 parameters.
model, x = models["bf16-mixed"]
print(inspect_policy(model, x[:8]))
