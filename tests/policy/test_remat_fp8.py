"""A user's remat policy saves the same residuals under every preset: with
``nn.scan(nn.remat(Block, policy=jax.checkpoint_policies.checkpoint_dots))`` an FP8 GEMM's
output is saved as a dot's output is on the unwrapped model, so the backward pass does not
run the forward GEMM again. References: the GEMMs of the compiled training step's HLO,
counted against the unwrapped bf16-mixed model's (per layer: 2 forward, 2 dgrad, 2 wgrad),
and the residuals ``jax.ad_checkpoint.print_saved_residuals`` lists.
"""

import contextlib
import io
import re

import flax.linen as nn
import jax
import jax.ad_checkpoint
import jax.numpy as jnp
import pytest

from fmtkit import with_policy

L, D = 3, 32


class Block(nn.Module):
    @nn.compact
    def __call__(self, h, _):
        return h + nn.Dense(D, name="out")(nn.gelu(nn.Dense(4 * D, name="up")(h))), None


class Net(nn.Module):
    policy: object = jax.checkpoint_policies.checkpoint_dots

    @nn.compact
    def __call__(self, x):
        stack = nn.scan(nn.remat(Block, policy=self.policy), variable_axes={"params": 0},
                        split_rngs={"params": True}, length=L)
        h, _ = stack(name="blocks")(x, None)
        return nn.Dense(4, name="head")(h)


def _step(preset, policy=jax.checkpoint_policies.checkpoint_dots):
    model = with_policy(Net(policy), preset)
    x = jax.random.normal(jax.random.key(1), (16, D))
    variables = model.init(jax.random.key(0), x)
    params = variables["params"]
    state = {k: v for k, v in variables.items() if k != "params"}

    def loss(p, x):
        return jnp.mean(model.apply({"params": p, **state}, x) ** 2)

    return loss, params, x


def _dots(preset, policy=jax.checkpoint_policies.checkpoint_dots):
    """The dots of the compiled training step (each loop body's counted once: one layer)."""
    loss, params, x = _step(preset, policy)
    hlo = jax.jit(jax.value_and_grad(loss)).lower(params, x).compile().as_text()
    return len(re.findall(r" dot\(", hlo))


def _residuals(preset, policy=jax.checkpoint_policies.checkpoint_dots):
    loss, params, x = _step(preset, policy)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        jax.ad_checkpoint.print_saved_residuals(loss, params, x)
    # (shape of each saved value, "from the argument" or what made it), dtypes aside: the
    # FP8 GEMM's output and the bf16 dot's are both the compute dtype's
    return sorted(re.sub(r"(bf16|f32|f16)\[", "[", line.split(" from ")[0])
                  for line in out.getvalue().splitlines())


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["fp8-delayed", "fp8-current"])
def test_checkpoint_dots_saves_the_fp8_gemm_outputs(preset):
    # By hand: the forward loop's 2 GEMMs, the backward loop's 4 (2 dgrad, 2 wgrad; the
    # saved dot outputs are not computed again), the head's forward, dgrad and wgrad.
    assert _dots("bf16-mixed") == 2 + 4 + 3
    assert _dots(preset) == 2 + 4 + 3


@pytest.mark.slow
def test_a_names_only_policy_saves_no_fp8_gemm_output():
    """``save_only_these_names`` saves the user's names only: the FP8 GEMM's internal name is
    not one of them, so the backward pass recomputes the first GEMM, as on the unwrapped
    model (one dot more than under checkpoint_dots)."""
    policy = jax.checkpoint_policies.save_only_these_names("mine")
    assert _dots("bf16-mixed", policy) == 2 + 4 + 3 + 1
    assert _dots("fp8-current", policy) == 2 + 4 + 3 + 1


@pytest.mark.slow
def test_saved_residuals_match_the_unwrapped_models():
    ref = _residuals("bf16-mixed")
    assert _residuals("fp8-current") == ref
