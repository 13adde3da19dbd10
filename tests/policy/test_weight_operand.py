"""A parameter written on the left of a matmul (Equinox's ``eqx.nn.Linear`` computes
``weight @ x``; under ``jax.vmap`` its ``dot_general`` has the weight as lhs) is the FP8
GEMM's weight: it gets the recipe's weight format, tiling and amax-history row, and its
gradient is the weight gradient, as if the model were written ``x @ weight.T``.

The references are independent of fmtkit's report: the jaxpr is read by a walker that
counts the shapes of the scales (the ``reduce_max`` outputs) and of the operands cast to
FP8; the numbers are compared with the same model written activation-first.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from child_env import child_env
from jaxpr_utils import iter_eqns

from fmtkit import fp8, with_policy
from fmtkit._switches import flipped

# The hidden GEMM: weight [N=256, K=384], activation [M=16, K=384]. N != K, so the weight's
# 128x128 block grid ([K/128, N/128] = [3, 2]) and the activation's 1x128 tiles ([16, 3])
# cannot be mistaken for the other operand's (the weight in tiles, [256, 3]; the activation
# in blocks, [3, 1]).
M, K, N = 16, 384, 256
_keys = jax.random.split(jax.random.key(5), 3)
LINEAR = eqx.nn.Linear(K, N, key=_keys[0])
HEAD = jax.random.normal(_keys[1], (4, N)) / 16
X = jax.random.normal(_keys[2], (M, K)).at[:, 3].mul(100.0)  # an outlier channel
PARAMS = {"lin": LINEAR, "head": HEAD}


def weight_left(p, x):
    """Equinox style: ``eqx.nn.Linear`` on one example (``weight @ x + bias``), batched."""
    h = jax.vmap(p["lin"])(x)
    return jnp.tanh(h) @ p["head"].T  # the output head, written alike in both models


def weight_right(p, x):
    """The same model written activation-first."""
    h = x @ p["lin"].weight.T + p["lin"].bias[None, :]
    return jnp.tanh(h) @ p["head"].T


def _loss(model):
    return lambda p, x: jnp.sum(model(p, x).astype(jnp.float32) ** 2)


def _scale_shapes(closed) -> list[tuple[int, ...]]:
    """The shapes of the non-scalar scales (``reduce_max`` outputs), in program order."""
    return [s for s in (tuple(e.outvars[0].aval.shape) for e in iter_eqns(closed)
                        if e.primitive.name == "reduce_max") if s]


def _fp8_cast_shapes(closed) -> list[tuple[int, ...]]:
    """The input shapes of the casts to FP8, in program order: tiles ``[rows, tiles, 128]``,
    blocks ``[blocks, 128, blocks, 128]``, or whole tensors."""
    return [tuple(e.invars[0].aval.shape) for e in iter_eqns(closed)
            if e.primitive.name == "convert_element_type"
            and jnp.dtype(e.params["new_dtype"]).name.startswith("float8")]


def _check_blockwise_roles(model):
    f = with_policy(_loss(model), "fp8-blockwise")
    fwd = jax.make_jaxpr(f)(PARAMS, X)
    # Forward: the activation [16, 384] in 1x128 tiles, one scale each, [16, 3]; the weight
    # [256, 384] in 128x128 blocks, [K/128, N/128] = [3, 2].
    assert _scale_shapes(fwd) == [(M, K // 128), (K // 128, N // 128)]
    assert _fp8_cast_shapes(fwd) == [(M, K // 128, 128), (K // 128, 128, N // 128, 128)]
    # Backward, after the forward's two: the output gradient [16, 256] in 1x128 tiles for
    # the data gradient, [16, 2]; for the weight gradient it and the activation are tiled
    # along their 16 rows (the contraction, padded to one 128-tile): one scale per column,
    # [256] and [384].
    bwd = jax.make_jaxpr(jax.grad(f))(PARAMS, X)
    assert _scale_shapes(bwd) == [(M, K // 128), (K // 128, N // 128), (M, N // 128), (N,),
                                  (K,)]


@pytest.mark.parametrize("model", [weight_left, weight_right], ids=["weight@x", "x@w.T"])
def test_blockwise_gives_the_weight_blocks_and_the_activation_tiles(model):
    _check_blockwise_roles(model)


def test_blockwise_roles_negative_control():
    # Without the swap, the left operand (the weight) would be quantized as the activation.
    with flipped(weight_on_either_side=False), pytest.raises(AssertionError):
        _check_blockwise_roles(weight_left)


def _value_and_grads(model, preset):
    return jax.jit(jax.value_and_grad(with_policy(_loss(model), preset)))(PARAMS, X)


def _assert_identical(a, b):
    assert np.array_equal(np.asarray(a[0]), np.asarray(b[0])), (a[0], b[0])
    for u, v in zip(jax.tree.leaves(a[1]), jax.tree.leaves(b[1]), strict=True):
        assert np.array_equal(np.asarray(u), np.asarray(v))


@pytest.mark.parametrize("preset", ["fp8-blockwise", "fp8-current"])
def test_weight_at_x_equals_the_activation_first_model(preset):
    # Bit for bit: the swapped GEMM is the activation-first GEMM (same quantized operands,
    # same f32 GEMMs); the transposes around it move values without rounding.
    left = _value_and_grads(weight_left, preset)
    _assert_identical(left, _value_and_grads(weight_right, preset))
    # and the FP8 path ran: not bf16-mixed's numbers
    assert left[0] != _value_and_grads(weight_right, "bf16-mixed")[0]


def test_fp32_is_the_unwrapped_model_bit_for_bit():
    _assert_identical(_value_and_grads(weight_left, "fp32"),
                      jax.jit(jax.value_and_grad(_loss(weight_left)))(PARAMS, X))


def _bf16_amax(a) -> float:
    return float(np.abs(np.asarray(a).astype(ml_dtypes.bfloat16).astype(np.float32)).max())


def test_delayed_history_records_the_weight_in_its_row():
    # A delayed recipe's history has rows x, w, grad: after one step the w row holds the
    # amax of bf16(weight) and the x row that of bf16(x), whichever side the weight is on.
    policied = with_policy(weight_left, "fp8-delayed")
    state = policied.init_fp8_state(PARAMS, X)
    assert len(state) == 1  # the hidden GEMM; the head is never FP8
    (key,) = state

    def loss(s):
        return jnp.sum(policied(PARAMS, X, fp8_state=s).astype(jnp.float32) ** 2)

    new = fp8.update_state(state, jax.jit(jax.grad(loss))(state))
    row = np.asarray(new[key][:, 0])
    assert _bf16_amax(X) != _bf16_amax(LINEAR.weight)
    assert row[0] == _bf16_amax(X) and row[1] == _bf16_amax(LINEAR.weight), row
    assert row[2] > 0


# An explicit-sharding mesh (4 simulated devices, in a subprocess): the traced out_sharding
# of a weight-on-the-left GEMM is laid out for the swapped GEMM and holds again for the
# result transposed back.
_EXPLICIT_MESH_SCRIPT = r'''
import json, os
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")  # tests/child_env.py's
                           + " --xla_force_host_platform_device_count=4"
                           " --xla_allow_excess_precision=false")  # (as tests/conftest.py)
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
from fmtkit.policy import with_policy

mesh = jax.make_mesh((2, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
rng = np.random.default_rng(0)
X = rng.standard_normal((16, 384)).astype(np.float32)
PARAMS = {"w": (rng.standard_normal((256, 384)) / 16).astype(np.float32),
          "o": (rng.standard_normal((3, 256)) / 8).astype(np.float32)}

def left(p, x):  # w @ x.T asked to come out [features over "model", tokens over "data"]
    h = jnp.matmul(p["w"], x.T, out_sharding=P("model", "data")).T
    return jnp.tanh(h) @ p["o"].T

def right(p, x):
    return jnp.tanh(jnp.matmul(x, p["w"].T, out_sharding=P("data", "model"))) @ p["o"].T

def run(model, preset, p, x):
    f = with_policy(model, preset)
    value, grads = jax.jit(jax.value_and_grad(lambda p, x: jnp.sum(f(p, x) ** 2)))(p, x)
    return jax.jit(f)(p, x), value, grads

def transposed_back(closed):
    # the specs of the [256, 16] results of transposes of [16, 256] values
    found = []
    def walk(j):
        for e in j.eqns:
            if (e.primitive.name == "transpose" and e.invars[0].aval.shape == (16, 256)
                    and e.outvars[0].aval.shape == (256, 16)):
                found.append(str(e.outvars[0].aval.sharding.spec))
            for sub in jax.extend.core.jaxprs_in_params(e.params):
                walk(getattr(sub, "jaxpr", sub))
    walk(closed.jaxpr)
    return found

out = {}
with jax.set_mesh(mesh):
    x = jax.device_put(X, NamedSharding(mesh, P("data")))
    p = jax.device_put(PARAMS, NamedSharding(mesh, P()))
    for preset in ("fp8-current", "fp8-blockwise"):
        a, b = run(left, preset, p, x), run(right, preset, p, x)
        out[preset] = {
            "specs": transposed_back(jax.make_jaxpr(with_policy(left, preset))(p, x)),
            "exact": all(np.array_equal(np.asarray(u), np.asarray(w))
                         for u, w in zip(jax.tree.leaves(a), jax.tree.leaves(b)))}
print(json.dumps(out))
'''


@pytest.mark.slow
def test_explicit_sharding_mesh_keeps_the_traced_out_sharding():
    """The weight-on-the-left GEMM's traced out_sharding ([256, 16] as P("model", "data"))
    is what its result has after the swapped FP8 GEMM's [16, 256] result is transposed back;
    output, loss and gradients equal the activation-first model's on the same mesh."""
    import json
    import subprocess
    import sys

    env = child_env()
    done = subprocess.run([sys.executable, "-c", _EXPLICIT_MESH_SCRIPT], capture_output=True,
                          text=True, env=env, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    for preset, got in out.items():
        assert got == {"specs": ["P('model', 'data')"], "exact": True}, (preset, got)
