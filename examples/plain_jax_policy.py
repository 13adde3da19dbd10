"""A plain JAX / Equinox-style model under a precision policy, read back with inspect_policy.

The model is a pytree of arrays with a `__call__` (what Equinox modules are; written here
with `jax.tree_util.register_dataclass`, so no extra dependency). `with_policy` wraps a
function of it: `lambda m, x: m(x)`, whose first argument holds the parameters. The report
shows what each op computed in, and that every matmul FLOP ran under the policy.

Run: python examples/plain_jax_policy.py   (about 15 s on a 2-core CPU)
"""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_allow_excess_precision=false").strip()

import dataclasses

import jax
import jax.numpy as jnp
import optax

from fmtkit import inspect_policy, with_policy


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Linear:
    w: jax.Array
    b: jax.Array

    def __call__(self, x):
        return x @ self.w + self.b


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class RMSNorm:
    scale: jax.Array

    def __call__(self, x):  # written by hand: the policy computes its statistics in f32
        return x * jax.lax.rsqrt(jnp.mean(x**2, axis=-1, keepdims=True) + 1e-6) * self.scale


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class MLP:
    norm: RMSNorm
    fc: Linear
    head: Linear

    def __call__(self, x):
        return self.head(jax.nn.gelu(self.fc(self.norm(x))))


def init(key, d=32, hidden=128, classes=10):
    k1, k2 = jax.random.split(key)
    return MLP(RMSNorm(jnp.ones((d,))),
               Linear(jax.random.normal(k1, (d, hidden)) / d**0.5, jnp.zeros((1, hidden))),
               Linear(jax.random.normal(k2, (hidden, classes)) / hidden**0.5,
                      jnp.zeros((1, classes))))


key_x, key_t = jax.random.split(jax.random.key(0))
x = jax.random.normal(key_x, (512, 32))
labels = jnp.argmax(x @ jax.random.normal(key_t, (32, 10)), axis=-1)

model = init(jax.random.key(1))
forward = with_policy(lambda m, x: m(x), "bf16-mixed")   # m: the parameter argument
optimizer = optax.adam(3e-3)
opt_state = optimizer.init(model)


@jax.jit
def step(model, opt_state, bx, by):
    def loss_fn(m):
        logits = forward(m, bx)
        return optax.softmax_cross_entropy_with_integer_labels(logits, by).mean()

    loss, grads = jax.value_and_grad(loss_fn)(model)
    updates, opt_state = optimizer.update(grads, opt_state, model)
    return optax.apply_updates(model, updates), opt_state, loss


for i in range(100):
    rows = slice((i * 64) % 512, (i * 64) % 512 + 64)
    model, opt_state, loss = step(model, opt_state, x[rows], labels[rows])
print(f"final loss {float(loss):.4f}; parameters stay "
      f"{sorted({str(p.dtype) for p in jax.tree.leaves(model)})}")

report = inspect_policy(forward, model, x[:8], argnums=0)   # differentiate the model only
print(report)
assert report.policied_fraction() == 1.0   # every matmul FLOP, forward and backward
