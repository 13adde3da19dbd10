"""Clear errors for two mistakes a user makes: an NNX delayed-FP8 state created inside the
training step (it must exist before the step differentiates it), and a debug configuration
file with a syntax error (``ValueError`` naming the file, as ``DebugConfig.load`` promises).
"""

from __future__ import annotations

import jax.numpy as jnp
import pytest
from flax import nnx

import fmtkit
from fmtkit import fp8, with_policy
from fmtkit.debug import DebugConfig

DelayedScalingVariable = fmtkit.policy.DelayedScalingVariable


class Net(nnx.Module):
    def __init__(self, rngs):
        self.fc, self.out = nnx.Linear(8, 32, rngs=rngs), nnx.Linear(32, 4, rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.relu(self.fc(x)))


@pytest.mark.slow  # two compiled NNX training steps (about 5 s)
def test_an_nnx_delayed_state_made_inside_the_step_says_to_make_it_outside():
    x = jnp.ones((16, 8))
    model = with_policy(Net(nnx.Rngs(0)), "fp8-delayed")  # no model(x) before the step

    @nnx.jit
    def train_step(model):
        diff = nnx.DiffState(0, (nnx.Param, DelayedScalingVariable))
        grads = nnx.grad(lambda m: jnp.mean(m(x) ** 2), argnums=diff)(model)
        _, observed = nnx.split_state(grads, nnx.Param, DelayedScalingVariable)
        nnx.update(model, fp8.update_state(nnx.state(model, DelayedScalingVariable), observed))

    with pytest.raises(ValueError, match=r"(?s)observed holds no observation.*created inside "
                       r"the differentiated function.*call the model once outside the "
                       r"training step"):
        train_step(model)
    # Made outside, as the message says, the same step records the observed amaxes.
    model(x)
    train_step(model)
    [hist] = nnx.state(model, DelayedScalingVariable)["fp8_state"].get_value().values()
    assert float(hist[0, 0]) == 1.0  # the first layer's observed x amax: max |x| = 1


def test_update_state_still_names_both_trees_for_other_mismatches():
    state = {"a": fp8.init_state("delayed")}
    with pytest.raises(ValueError, match=r"observed must be a tree of the same structure") \
            as err:
        fp8.update_state(state, {"b": fp8.init_state("delayed")})
    assert "outside the training step" not in str(err.value)


@pytest.mark.parametrize("name,text,line", [
    ("debug.yaml", "rules:\n  - pattern: Dense\n    freq: [1, 2\n", 3),  # unclosed [
    ("debug.yml", "rules: {pattern: 'Dense'\n", 1),  # unclosed {
    ("debug.toml", "[[rules]]\npattern = Dense\n", 2),  # an unquoted string
])
def test_a_config_file_with_a_syntax_error_is_a_value_error_naming_the_file(
        tmp_path, name, text, line):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ValueError, match=r"is not valid (YAML|TOML)") as err:
        DebugConfig.load(path)
    assert type(err.value) is ValueError
    assert str(path) in str(err.value) and "<unicode string>" not in str(err.value)
    assert f"line {line}, column" in str(err.value)
