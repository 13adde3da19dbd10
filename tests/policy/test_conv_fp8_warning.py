"""Convolutions under FP8/FP4 presets: they run on the compute dtype, and the policy says so.

fmtkit's FP8 GEMMs are ``dot_general`` only, so a convolution in a module whose policy has an
FP8 recipe runs on the compute dtype. Each policied call (one per trace under ``jit``) warns
once, naming every such module, the dtype it runs on and how to silence it. Conv dtypes are
read from the jaxpr with ``jaxpr_utils`` (a walker that knows nothing of the policy).
"""

import dataclasses
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jaxpr_utils import iter_eqns, operand_dtypes

from fmtkit._switches import flipped
from fmtkit.policy import get_preset, with_policy

BF16 = jnp.dtype("bfloat16")
X = jnp.asarray(np.random.default_rng(0).standard_normal((2, 6, 6, 3)), jnp.float32)
WARNING = "Convolutions in module"


class LinenConvNet(nn.Module):
    @nn.compact
    def __call__(self, x):
        stem, mid = nn.Conv(4, (3, 3), name="stem"), nn.Conv(4, (3, 3), name="mid")
        h = stem(x)
        for _ in range(3):  # the same conv called three times: still one warning
            h = jax.nn.relu(mid(h))
        return nn.Dense(5, name="head")(jnp.mean(h, axis=(1, 2)))


class NnxConvNet(nnx.Module):
    def __init__(self, rngs):
        self.stem = nnx.Conv(3, 4, (3, 3), rngs=rngs)
        self.mid = nnx.Conv(4, 4, (3, 3), rngs=rngs)
        self.hidden = nnx.Linear(4, 8, rngs=rngs)
        self.head = nnx.Linear(8, 5, rngs=rngs)

    def __call__(self, x):
        h = self.stem(x)
        for _ in range(3):
            h = jax.nn.relu(self.mid(h))
        return self.head(jax.nn.relu(self.hidden(jnp.mean(h, axis=(1, 2)))))


class NnxMlp(nnx.Module):
    def __init__(self, rngs):
        self.hidden = nnx.Linear(3, 8, rngs=rngs)
        self.head = nnx.Linear(8, 5, rngs=rngs)

    def __call__(self, x):
        return self.head(jax.nn.relu(self.hidden(jnp.mean(x, axis=(1, 2)))))


def _linen_loss(policied):
    variables = policied.init(jax.random.key(0), X)
    return lambda x: jnp.sum(policied.apply(variables, x))


def _nnx_loss(policied):
    with warnings.catch_warnings():  # a delayed recipe creates its state at the first call
        warnings.filterwarnings("ignore", message=WARNING)
        policied(X)
    return lambda x: jnp.sum(policied(x))


MODELS = {"linen": (LinenConvNet, _linen_loss), "nnx": (lambda: NnxConvNet(nnx.Rngs(0)),
                                                        _nnx_loss)}


def _caught(fn, *args):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fn(*args)
    return out, [str(w.message) for w in caught if str(w.message).startswith(WARNING)]


def _conv_dtypes(closed):
    return [operand_dtypes(e) for e in iter_eqns(closed)
            if e.primitive.name == "conv_general_dilated"]


@pytest.mark.parametrize("preset", ["fp8-current", "fp8-delayed", "nvfp4"])
@pytest.mark.parametrize("api", sorted(MODELS))
def test_fp8_presets_warn_once_per_trace_naming_the_conv_modules(api, preset):
    build, loss = MODELS[api]
    fn = loss(with_policy(build(), preset))
    closed, caught = _caught(jax.make_jaxpr(jax.jit(jax.grad(fn))), X)
    assert len(caught) == 1, caught  # 4 forward conv calls, their gradients: one warning
    recipe = get_preset(preset).default.fp8.name
    assert caught[0].startswith(f"{WARNING}(s) 'stem', 'mid' run on bfloat16 (the compute "
                                f"dtype), not with the FP8 recipe {recipe}"), caught
    assert "type:Conv" in caught[0] and "filterwarnings" in caught[0]
    # What the warning says is what runs: every conv, forward and backward, bf16 x bf16.
    convs = _conv_dtypes(closed)
    # (4 forward calls and their input gradients; only x is differentiated: no wgrad)
    assert len(convs) == 8 and set(convs) == {(BF16, BF16)}, convs


def test_warning_once_per_trace_jitted_exactly():
    """Under ``jax.jit`` the warning is raised while tracing: once, then never again for
    that signature."""
    fn = _nnx_loss(with_policy(NnxConvNet(nnx.Rngs(0)), "fp8-current"))
    step = jax.jit(jax.grad(fn))
    counts = [len(_caught(step, x)[1]) for x in (X, X, X[:1])]
    assert counts == [1, 0, 1], counts


@pytest.mark.parametrize("api", sorted(MODELS))
def test_no_warning_under_bf16_mixed(api):
    build, loss = MODELS[api]
    closed, caught = _caught(jax.make_jaxpr(jax.grad(loss(with_policy(build(),
                                                                      "bf16-mixed")))), X)
    assert caught == [] and set(_conv_dtypes(closed)) == {(BF16, BF16)}


def test_no_warning_without_convs():
    fn = _nnx_loss(with_policy(NnxMlp(nnx.Rngs(0)), "fp8-current"))
    assert _caught(jax.make_jaxpr(jax.grad(fn)), X)[1] == []


def test_a_rule_without_fp8_for_the_convs_silences_it():
    """The rule the warning suggests states in the rules what runs (bf16 convs) and silences
    the warning; the Linear keeps its FP8 recipe."""
    preset = get_preset("fp8-current")
    rules = dataclasses.replace(preset, rules=[("type:Conv", "p=f32,c=bf16,o=bf16"),
                                               *preset.rules])
    fn = _nnx_loss(with_policy(NnxConvNet(nnx.Rngs(0)), rules))
    closed, caught = _caught(jax.make_jaxpr(jax.grad(fn)), X)
    assert caught == []
    assert set(_conv_dtypes(closed)) == {(BF16, BF16)}
    fp8_dots = [operand_dtypes(e) for e in iter_eqns(closed) if e.primitive.name == "dot_general"
                and any(d.itemsize == 1 for d in operand_dtypes(e))]
    assert fp8_dots  # the hidden Linear, forward and backward


def test_the_documented_filter_silences_it():
    fn = _nnx_loss(with_policy(NnxConvNet(nnx.Rngs(0)), "fp8-current"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", message="Convolutions in module")
        jax.make_jaxpr(jax.grad(fn))(X)  # would raise on any other warning


@pytest.mark.parametrize("mutation", ["silent", "per_call"])
def test_negative_control(mutation):
    """Without the warning, or with one per convolution call, the checks above fail."""
    with (flipped(fp8_conv_warning="never" if mutation == "silent" else "per_conv"),
          pytest.raises(AssertionError)):
        test_warning_once_per_trace_jitted_exactly()
