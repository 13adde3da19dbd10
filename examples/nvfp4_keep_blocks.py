"""NVFP4 training of a small transformer LM, with its last block kept in BF16.

The NVFP4 paper (arXiv 2509.25149) trains with E2M1 GEMMs (1x16 blocks, E4M3 block scales,
16x16 weight blocks, stochastic rounding of gradients, a random Hadamard transform on the
weight-gradient inputs) and keeps a few blocks in BF16, mostly the last ones. Here:
`fmtkit.policy.keep_blocks` finds the model's layer stack from its module paths and keeps
the last block under bf16-mixed; every other projection runs the "nvfp4" recipe. Trained
side by side with bf16-mixed on the embedded byte-level corpus (its entropy rate, 1.517
nats per byte, is the floor of any loss).

Run: python examples/nvfp4_keep_blocks.py   (under a minute on a 2-core CPU)
"""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_allow_excess_precision=false").strip()

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fmtkit import inspect_policy, module_paths, with_policy
from fmtkit.policy import keep_blocks
from studies.lib.corpus import default_corpus
from studies.lib.models import TransformerConfig, TransformerLM

cfg = TransformerConfig(d_model=32, num_heads=2, num_layers=3, d_ff=64, max_len=16)
data = np.frombuffer(default_corpus(1 << 16), np.uint8).astype(np.int32)
rng = np.random.default_rng(0)
batches = [np.stack([data[s:s + 17] for s in rng.integers(0, len(data) - 17, 16)])
           for _ in range(30)]

lm = TransformerLM(cfg)
paths = module_paths(lm, jnp.zeros((2, 16), jnp.int32))
kept = keep_blocks("nvfp4", paths, last=1)          # Block_2 in BF16, the rest NVFP4
assert kept.resolve("Block_2/MlpBlock_0/Dense_0").fp8 is None
assert kept.resolve("Block_0/MlpBlock_0/Dense_0").fp8.name == "nvfp4"


def train(name, rules):
    model = with_policy(lm, rules)
    params = model.init(jax.random.key(0), jnp.zeros((2, 16), jnp.int32))["params"]
    optimizer = optax.adamw(3e-3)
    state = optimizer.init(params)

    @jax.jit
    def step(params, state, batch):
        def loss_fn(p):
            logits = model.apply({"params": p}, batch[:, :-1]).astype(jnp.float32)
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, state = optimizer.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    losses = []
    for batch in batches:
        params, state, loss = step(params, state, jnp.asarray(batch))
        losses.append(float(loss))
    print(f"{name:24s} loss over the last 10 steps {np.mean(losses[-10:]):.4f} nats/byte")
    return model


train("bf16-mixed", "bf16-mixed")
model = train("nvfp4, last block bf16", kept)

# The report names each GEMM's format and block shapes: float4_e2m1fn with 1x16 / 16x16
# blocks in Block_0 and Block_1, bfloat16 in Block_2 and the head.
report = inspect_policy(model, jnp.zeros((2, 16), jnp.int32))
for op in report.matmul_ops:
    if op.path.endswith("MlpBlock_0/Dense_0") and op.kind == "forward":
        print(f"{op.path:26s} {op.dtypes:36s} {op.blocks}")
