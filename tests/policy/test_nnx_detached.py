"""NNX modules run outside the model's own graph: their matmuls get the path they run under.

The NNX ways of running a layer that is not (or not as such) a node of the model: a temporary
``nnx.Linear``/``nnx.Conv`` built in ``__call__`` and given the module's weight, ``nnx.merge``
of a graphdef kept from ``__init__``, weight standardization by ``nnx.split`` / ``nnx.merge``
or ``nnx.clone`` of the module's own conv, a tied head through ``embed.attend`` or a
functional use of the embedding table, ``nnx.call``. A detached layer's matmuls are filed
under the module whose call runs them, or, where split/merge/clone keep a model module's
class, under that module (whose parameters it uses): so a ``subtree:`` rule on the block
reaches them (linen's detached ``Module.apply`` is placed under its caller likewise). Matmul
dtypes are read from the jaxpr of the gradient by shape (a walker that knows nothing of the
policy's report).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jaxpr_utils import iter_eqns, operand_dtypes

from fmtkit._switches import flipped
from fmtkit.policy import get_preset, inspect_policy, with_policy
from fmtkit.policy._engine import scopes

BF16, F32 = jnp.dtype("bfloat16"), jnp.dtype("float32")
RNG = np.random.default_rng(0)
VEC = jnp.asarray(RNG.standard_normal((2, 4)), jnp.float32)
IMG = jnp.asarray(RNG.standard_normal((2, 5, 5, 4)), jnp.float32)


def _standardize(k):
    axes = (0, 1, 2)
    return (k - jnp.mean(k, axis=axes, keepdims=True)) / (
        jnp.std(k, axis=axes, keepdims=True) + 1e-5)


def _param(rngs, shape):
    return nnx.Param(jax.random.normal(rngs.params(), shape, jnp.float32) / 3)


# ---------------------------------------------------------------------------------------------
# The idioms, each the block of a small model (pre -> block -> head).

class TempLinear(nnx.Module):
    """A temporary nnx.Linear built in __call__ and given this module's weight."""

    def __init__(self, rngs):
        self.w = _param(rngs, (6, 6))

    def __call__(self, h):
        lin = nnx.Linear(6, 6, use_bias=False, rngs=nnx.Rngs(0))
        lin.kernel = nnx.Param(self.w[...])
        return lin(h)


class MergedLinear(nnx.Module):
    """nnx.merge of a graphdef kept from __init__, with this module's weight."""

    def __init__(self, rngs):
        self.w = _param(rngs, (6, 6))
        self.graphdef = nnx.graphdef(nnx.Linear(6, 6, use_bias=False, rngs=rngs))

    def __call__(self, h):
        return nnx.merge(self.graphdef, nnx.State({"kernel": nnx.Param(self.w[...])}))(h)


class TiedAttend(nnx.Module):
    """A tied output projection: the embedding table's attend."""

    def __init__(self, rngs):
        self.embed = nnx.Embed(6, 6, rngs=rngs)

    def __call__(self, h):
        return self.embed.attend(h)


class TiedFunctional(nnx.Module):
    """A tied projection written by hand from another module's parameter."""

    def __init__(self, rngs):
        self.embed = nnx.Embed(6, 6, rngs=rngs)

    def __call__(self, h):
        return h @ self.embed.embedding[...].T


class FunctionalCall(nnx.Module):
    """nnx.call on the split sub-module (the functional API)."""

    def __init__(self, rngs):
        self.lin = nnx.Linear(6, 6, rngs=rngs)

    def __call__(self, h):
        out, _ = nnx.call(nnx.split(self.lin))(h)
        return out


class WSConvSplit(nnx.Module):
    """Weight standardization: the module's conv split, its kernel standardized, merged."""

    def __init__(self, rngs):
        self.conv = nnx.Conv(6, 6, (3, 3), rngs=rngs)

    def __call__(self, h):
        graphdef, state = nnx.split(self.conv)
        state["kernel"] = nnx.Param(_standardize(state["kernel"][...]))
        return nnx.merge(graphdef, state)(h)


class WSConvClone(nnx.Module):
    """Weight standardization on a clone of the module's conv."""

    def __init__(self, rngs):
        self.conv = nnx.Conv(6, 6, (3, 3), rngs=rngs)

    def __call__(self, h):
        conv = nnx.clone(self.conv)
        conv.kernel = nnx.Param(_standardize(self.conv.kernel[...]))
        return conv(h)


class WSConvTemp(nnx.Module):
    """Weight standardization with a temporary nnx.Conv given the standardized kernel."""

    def __init__(self, rngs):
        self.kernel = _param(rngs, (3, 3, 6, 6))

    def __call__(self, h):
        conv = nnx.Conv(6, 6, (3, 3), use_bias=False, rngs=nnx.Rngs(0))
        conv.kernel = nnx.Param(_standardize(self.kernel[...]))
        return conv(h)


# idiom -> (block class, whether it is a conv, the path its matmuls get)
IDIOMS = {
    "temporary_linear": (TempLinear, False, "block"),
    "merge_kept_graphdef": (MergedLinear, False, "block"),
    "tied_attend": (TiedAttend, False, "block/embed"),
    "tied_functional": (TiedFunctional, False, "block"),
    "nnx_call": (FunctionalCall, False, "block/lin"),
    "ws_conv_split_merge": (WSConvSplit, True, "block/conv"),
    "ws_conv_clone": (WSConvClone, True, "block/conv"),
    "ws_conv_temporary": (WSConvTemp, True, "block"),
}


class Model(nnx.Module):
    def __init__(self, block, conv, rngs):
        self.conv = conv
        self.pre = nnx.Linear(4, 6, rngs=rngs)
        self.block = block(rngs)
        self.head = nnx.Linear(6, 3, rngs=rngs)

    def __call__(self, x):
        h = jax.nn.relu(self.block(jnp.tanh(self.pre(x))))
        return self.head(jnp.mean(h, axis=(1, 2)) if self.conv else h)


def _build(idiom):
    block, conv, _ = IDIOMS[idiom]
    return Model(block, conv, nnx.Rngs(0)), (IMG if conv else VEC)


def _loss_fn(model, x):
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(p):
        return jnp.sum(nnx.merge(graphdef, p, rest)(x))

    return loss, params


def _block_rules():
    preset = get_preset("bf16-mixed")
    return dataclasses.replace(preset, rules=[("subtree:block", "p=f32,c=f32,o=f32"),
                                              *preset.rules])


def _is_block(eqn) -> bool:
    """The block's matmuls, by shape: its convolutions (the only ones), or a dot_general with
    a 6 x 6 operand or result (the block's weight, its transpose, its weight gradient)."""
    if eqn.primitive.name == "conv_general_dilated":
        return True
    shapes = [v.aval.shape for v in (*eqn.invars[:2], *eqn.outvars)]
    return (6, 6) in shapes


def _matmul_dtypes(model, x):
    """(block, other) lists of matmul operand dtypes in the jaxpr of the gradient."""
    loss, params = _loss_fn(model, x)
    closed = jax.make_jaxpr(jax.grad(loss))(params)
    block, other = [], []
    for e in iter_eqns(closed):
        if e.primitive.name in ("dot_general", "conv_general_dilated"):
            (block if _is_block(e) else other).append(operand_dtypes(e))
    return block, other


@pytest.mark.parametrize("idiom", sorted(IDIOMS))
def test_a_subtree_rule_reaches_the_detached_matmuls(idiom):
    """Under bf16-mixed with ``subtree:block`` in f32, the block's matmuls (forward, dgrad,
    wgrad) compute f32 x f32, every other matmul bf16 x bf16."""
    model, x = _build(idiom)
    block, other = _matmul_dtypes(with_policy(model, _block_rules()), x)
    assert len(block) == 3 and set(block) == {(F32, F32)}, block
    assert other and set(other) == {(BF16, BF16)}, other


@pytest.mark.parametrize("idiom", sorted(IDIOMS))
def test_inspect_policy_files_them_under_that_path(idiom):
    model, x = _build(idiom)
    report = inspect_policy(with_policy(model, _block_rules()), x)
    want = IDIOMS[idiom][2]
    paths = {m.kind: set() for m in report.matmul_ops}
    for m in report.matmul_ops:
        paths[m.kind].add(m.path)
    assert paths["forward"] == {"pre", want, "head"}, paths
    block_flops = [m for m in report.matmul_ops if m.path == want]
    # Forward, dgrad and the kernel's gradient (a standardized kernel is not a view of the
    # parameter: the report labels its gradient conv as a dgrad).
    kinds = sorted(m.kind for m in block_flops)
    standardized = idiom.startswith("ws_conv")
    assert kinds == sorted(["forward", "dgrad", "dgrad" if standardized else "wgrad"]), kinds
    assert all(m.dtypes.startswith("float32 x float32") for m in block_flops), block_flops
    assert report.modules[want].policy.compute_dtype == F32


@pytest.mark.parametrize("idiom", [
    pytest.param(i, marks=() if i in ("temporary_linear", "tied_attend", "ws_conv_split_merge")
                 else pytest.mark.slow) for i in sorted(IDIOMS)])
def test_fp32_is_bit_identical(idiom):
    model, x = _build(idiom)
    for run in (jax.jit, lambda f: f):
        results = []
        for m in (model, with_policy(model, "fp32")):
            loss, params = _loss_fn(m, x)
            results.append(jax.tree.leaves(run(jax.value_and_grad(loss))(params)))
        assert len(results[0]) == len(results[1])
        for a, b in zip(*results):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _own_root_scope(fn):
    """A layer's call in a scope with its own root path "": what a detached linen
    ``Module.apply`` got before it was placed under its caller."""
    def method(self, *args, **kwargs):
        with scopes.module_scope("", ()):
            return fn(self, *args, **kwargs)

    return method


@pytest.mark.parametrize("idiom", ["temporary_linear", "tied_attend", "ws_conv_split_merge"])
def test_negative_control(monkeypatch, idiom):
    """With each layer's call filed under a root path of its own, the checks above fail."""
    for cls, name in ((nnx.Linear, "__call__"), (nnx.Conv, "__call__"),
                      (nnx.Embed, "attend")):
        monkeypatch.setattr(cls, name, _own_root_scope(getattr(cls, name)))
    with flipped(trace_cache=False):
        with pytest.raises(AssertionError):
            test_a_subtree_rule_reaches_the_detached_matmuls(idiom)
        with pytest.raises(AssertionError):
            test_inspect_policy_files_them_under_that_path(idiom)
