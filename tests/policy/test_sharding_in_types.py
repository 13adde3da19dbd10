"""Sharding in types inside a policied model: ``auto_axes``, ``explicit_axes``, ``reshard``
on an ``AxisType.Explicit`` mesh, ``set_mesh`` inside the model, and a Qwen3-style MoE
(attention under ``auto_axes``, routing through ``reshard``, ``lax.ragged_dot`` experts in
``shard_map``) training under every preset on 4 simulated CPU devices (one subprocess,
sharding_in_types_checks.py, so the rest of the suite keeps its single device).

Expected values: the unwrapped model's own losses and gradients (``fp32`` bit for bit), the
FP8 formats on the GEMM operands counted in the jaxpr against a hand count, and JAX's error
text where JAX refuses a construct in any trace.
"""

import functools
import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from child_env import child_env
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from fmtkit import with_policy

SCRIPT = Path(__file__).with_name("sharding_in_types_checks.py")


def model(p, x):
    """Counts under auto_axes, as JAX's LLM examples compute attention and router counts."""
    h = x @ p["w"]
    counts = jax.sharding.auto_axes(lambda h: jnp.sum((h > 0).astype(h.dtype), axis=-1),
                                    out_sharding=P("data"))(h)
    return (h * counts[:, None]) @ p["o"]


_RNG = np.random.default_rng(3)
PARAMS = {"w": jnp.asarray(_RNG.standard_normal((8, 8)), jnp.float32),
          "o": jnp.asarray(_RNG.standard_normal((8, 4)), jnp.float32)}
X = jnp.asarray(_RNG.standard_normal((4, 8)), jnp.float32)


def _value_and_grad(fn):
    return jax.jit(jax.value_and_grad(lambda p, x: jnp.sum(fn(p, x).astype(jnp.float32))))


@pytest.mark.slow
@pytest.mark.parametrize("placed", [True, False], ids=["on-mesh", "no-mesh"])
@pytest.mark.parametrize("preset", ["fp32", "bf16-mixed", "fp8-current"])
def test_auto_axes_on_an_explicit_mesh(preset, placed):
    """One device is enough: auto_axes types its region's values on a mesh of Auto axes
    whatever the device count. fp32: loss and gradients bit for bit the unwrapped model's;
    the others run (each op bound again under the mesh it was traced on). Inputs placed on
    the mesh, or made before it (on no mesh) and passed into the jit under it."""
    mesh = jax.make_mesh((1,), ("data",), axis_types=(AxisType.Explicit,))
    with jax.set_mesh(mesh):
        p, x = PARAMS, X
        if placed:
            p = jax.tree.map(lambda a: jax.device_put(a, P()), PARAMS)
            x = jax.device_put(X, P("data"))
        ref = _value_and_grad(model)(p, x)
        got = _value_and_grad(with_policy(model, preset))(p, x)
    if preset == "fp32":
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    else:
        # bf16 or FP8 operands on two matmuls; the counts (exact integers) multiply h,
        # so the loss moves by the operands' rounding: a few percent at most for E4M3
        # (2^-4 relative per operand).
        assert abs(float(got[0]) - float(ref[0])) <= 0.1 * abs(float(ref[0]))


@pytest.mark.slow
def test_auto_axes_negative_control():
    """Mutation: the region's ops bound under the enclosing (Explicit) mesh: JAX refuses."""
    from fmtkit._switches import flipped

    mesh = jax.make_mesh((1,), ("data",), axis_types=(AxisType.Explicit,))
    with (flipped(rebind_traced_mesh=False), jax.set_mesh(mesh),
          pytest.raises(ValueError, match="should match the aval mesh")):
        _value_and_grad(with_policy(model, "fp32"))(PARAMS, X)


@functools.cache
def results() -> dict:
    root = Path(__file__).resolve().parents[2]
    env = child_env(pythonpath=(root, root / "tests"))
    out = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True,
                         env=env, timeout=900)
    if out.returncode:
        pytest.fail(f"sharding-in-types checks failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("construct", ["auto_axes", "reshard", "explicit_axes"])
def test_constructs_fp32_bitwise_and_bf16_close(construct):
    r = results()[construct]
    assert isinstance(r, dict), r  # an "ERROR ..." string otherwise
    assert r["fp32_bitwise"]
    # bf16 operands (unit roundoff 2^-9) on two 8-wide matmuls and a tanh: the summed
    # outputs move by a few bf16 roundings.
    assert r["bf16_rel"] < 2.0**-5, r


@pytest.mark.slow
def test_set_mesh_inside_the_model_says_where_to_enter_the_mesh():
    """JAX refuses jax.set_mesh in any trace (jit included); the model runs eagerly only, and
    the policied call, which traces, says so."""
    r = results()["set_mesh_inside"]
    assert r["eager_ok"]
    assert r["error"] is not None and r["error"].startswith(
        "with_policy traces the model (as jax.jit does), and JAX refuses jax.set_mesh "
        "inside a trace")


@pytest.mark.slow
def test_qwen3_moe_fp32_is_the_unwrapped_model_bit_for_bit():
    r = results()
    assert isinstance(r["moe_fp32"], dict), r["moe_fp32"]
    assert r["moe_fp32"]["bitwise"]
    assert r["moe_fp32"]["losses"] == r["moe_unwrapped"]


# GEMMs of one training step (forward, dgrad, wgrad): 5 projections (q, k, v, o, router) as
# dot_general, 3 expert GEMMs (gate, up, down) as ragged_dot; the two attention einsums and
# the tied-embedding head (3 + 3 GEMMs) stay on bf16.
FP8_GEMMS = {
    "bf16-mixed": {"dot_general:bfloat16xbfloat16": 24, "ragged_dot_general:bfloat16xbfloat16": 9},
    "fp8-current": {  # E4M3 forward, E5M2 gradients
        "dot_general:float8_e4m3fnxfloat8_e4m3fn": 5,
        "dot_general:float8_e5m2xfloat8_e4m3fn": 5,
        "dot_general:float8_e4m3fnxfloat8_e5m2": 5,
        "dot_general:bfloat16xbfloat16": 9,
        "ragged_dot_general:float8_e4m3fnxfloat8_e4m3fn": 3,
        "ragged_dot_general:float8_e5m2xfloat8_e4m3fn": 3,
        "ragged_dot_general:float8_e4m3fnxfloat8_e5m2": 3},
    "fp8-blockwise": {  # E4M3 throughout (DeepSeek-V3)
        "dot_general:float8_e4m3fnxfloat8_e4m3fn": 15,
        "dot_general:bfloat16xbfloat16": 9,
        "ragged_dot_general:float8_e4m3fnxfloat8_e4m3fn": 9},
}


@pytest.mark.slow
@pytest.mark.parametrize("preset", list(FP8_GEMMS))
def test_qwen3_moe_trains_under_the_preset(preset):
    r = results()
    got, ref = r[f"moe_{preset}"], r["moe_unwrapped"]
    assert isinstance(got, dict), got
    assert got["gemms"] == FP8_GEMMS[preset]
    losses = got["losses"]
    assert all(np.isfinite(losses))
    assert losses[-1] < losses[0] - 1.0, losses  # it learns (ln 128 = 4.85 at the start)
    # The first step's loss is the unwrapped model's up to the operands' rounding.
    assert abs(losses[0] - ref[0]) < 0.05 * ref[0], (losses, ref)
