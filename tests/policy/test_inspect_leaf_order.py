"""inspect_policy on a function whose parameter pytree's flattening order is not its sorted
key order (an Equinox-style dataclass with fields ``w`` then ``b``)."""

import dataclasses

import jax
import jax.numpy as jnp

from fmtkit import inspect_policy, with_policy


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Linear:
    w: jax.Array  # "w" sorts after "b": a sorted rebuild would hand the bias to the matmul
    b: jax.Array

    def __call__(self, x):
        return x @ self.w + self.b


def test_leaves_keep_their_flattening_order():
    layer = Linear(jnp.ones((8, 32)), jnp.zeros((1, 32)))
    x = jnp.ones((4, 8))
    forward = with_policy(lambda m, x: m(x), "bf16-mixed")
    report = inspect_policy(forward, layer, x, argnums=0)
    assert report.policied_fraction() == 1.0
    # Before the fix the bias reached the matmul: tracing failed on (4, 8) @ (1, 32).
    assert {op.kind for op in report.matmul_ops} >= {"forward", "wgrad"}
