"""The bytes ledger, against byte counts worked out by hand from the dtypes."""

import dataclasses

import jax
import jax.numpy as jnp
import optax
import pytest

from fmtkit import BlockScaling, TensorScaling, optim
from fmtkit.memory import MemoryLedger, ledger

SHAPES = {"w1": (256, 512), "w2": (512, 128), "b": (128,)}
N = 256 * 512 + 512 * 128 + 128


def _params(dtype):
    return {k: jax.ShapeDtypeStruct(s, dtype) for k, s in SHAPES.items()}


def test_bf16_params_adamw_f32_master_is_16_bytes_per_param():
    led = ledger(_params(jnp.bfloat16), optim.master_weights(optax.adamw(1e-3)))
    assert led.num_params == N
    assert (led.param_bytes, led.grad_bytes, led.master_bytes) == (2 * N, 2 * N, 4 * N)
    assert led.opt_state_bytes == 8 * N  # mu and nu in f32 (built on the f32 master)
    assert led.scalar_bytes == 4 + 4  # Adam's count and master_weights' count (int32)
    assert led.bytes_per_param == 16.0
    assert led.total_bytes == 16 * N + 8


def test_loss_scale_adds_only_scalars():
    opt = optim.dynamic_loss_scale(optim.master_weights(optax.adamw(1e-3)))
    led = ledger(_params(jnp.float16), opt)
    assert led.bytes_per_param == 16.0
    # + f32 scale, four int32 counters and the bool last_step_skipped
    assert led.scalar_bytes == 8 + 4 * 5 + 1


def test_f32_adamw_is_16_bytes_without_master():
    led = ledger(_params(jnp.float32), optax.adamw(1e-3))
    assert led.per_param() == {"params": 4.0, "grads": 4.0, "master": 0.0, "opt_state": 8.0,
                               "total": 16.0}


def test_ms_amp_recipe():
    """bf16 params, f32 master, m in E4M3 (1 byte) and v in FP16 (2 bytes), per-tensor f32
    scales (one (1, 1) or (1,) scale per leaf and moment): 2 + 2 + 4 + 3 bytes per param."""
    opt = optim.master_weights(optim.adamw(1e-3, mu_dtype="e4m3", nu_dtype="fp16",
                                           nu_scaling=TensorScaling()))
    led = ledger(_params(jnp.bfloat16), opt)
    assert led.master_bytes == 4 * N
    assert led.opt_state_bytes == 3 * N + 2 * len(SHAPES) * 4
    assert led.per_param()["total"] == pytest.approx(11.0, abs=1e-3)


def test_block_scales_are_counted():
    opt = optim.scale_by_adam(mu_dtype="e4m3", nu_dtype="e4m3",
                              mu_scaling=BlockScaling((1, 128)), nu_scaling=BlockScaling((1, 128)))
    params = {"w": jax.ShapeDtypeStruct((256, 512), jnp.float32)}
    led = ledger(params, opt)
    n = 256 * 512
    assert led.opt_state_bytes == 2 * (n + (n // 128) * 4)  # e4m3 values + f32 per 1x128


def test_pure_bf16_options():
    p = _params(jnp.bfloat16)
    kahan = ledger(p, optim.kahan_updates(optax.adamw(1e-3)))
    assert kahan.per_param() == {"params": 2.0, "grads": 2.0, "master": 0.0,
                                 "opt_state": 4.0 + 2.0, "total": 10.0}  # bf16 m, v, comp.
    sr = ledger(p, optim.stochastic_round_updates(optax.adamw(1e-3)))
    assert sr.bytes_per_param == 8.0


def test_dtype_overrides_and_policy():
    p32 = _params(jnp.float32)
    a = ledger(p32, optim.master_weights(optax.adamw(1e-3)), param_dtype="bf16")
    assert a.bytes_per_param == 16.0

    @dataclasses.dataclass
    class Policy:  # duck-typed, like fmtkit.Policy
        param_dtype: object = jnp.bfloat16
        grad_dtype: object = jnp.float32

    b = ledger(p32, optim.master_weights(optax.adamw(1e-3)), policy=Policy())
    assert (b.param_bytes, b.grad_bytes) == (2 * N, 4 * N)
    c = ledger(p32, None, grad_dtype=jnp.bfloat16)
    assert (c.param_bytes, c.grad_bytes, c.opt_state_bytes) == (4 * N, 2 * N, 0)


def test_a_billion_parameters_without_allocating():
    params = {"w": jax.ShapeDtypeStruct((32768, 32768), jnp.bfloat16)}
    led = ledger(params, optim.master_weights(optax.adamw(1e-3)))
    assert led.num_params == 2**30 and led.total_bytes == 16 * 2**30 + 8


def test_real_arrays_and_report():
    params = {"w": jnp.zeros((4, 8), jnp.bfloat16)}
    led = ledger(params, optim.master_weights(optax.sgd(1.0)))
    assert isinstance(led, MemoryLedger) and led.bytes_per_param == 8.0
    text = str(led)
    assert "master copy" in text and "8.0000" in text
    assert led.as_dict()["bytes_per_param"]["total"] == 8.0


def test_bad_dtype():
    with pytest.raises(TypeError, match="param_dtype"):
        ledger(_params(jnp.float32), None, param_dtype=jnp.int8)


def test_fp4_storage_counts_packed_values_and_their_scales():
    from fmtkit import fp4

    w = jax.ShapeDtypeStruct((256, 512), jnp.float32)
    n = 256 * 512
    nv = jax.eval_shape(lambda t: fp4.nvfp4_quantize(t, (16, 16)), w)
    mx = jax.eval_shape(fp4.mxfp4_quantize, w)
    # NVFP4: 4 bits per value + one E4M3 byte per 16x16 block... of 256 values, + the f32
    # tensor scale; 1x16 blocks: one byte per 16 values. MXFP4: one E8M0 byte per 32.
    led = ledger({"w": nv})
    assert led.num_params == n
    assert led.param_bytes == n // 2 + n // 256 + 4
    one_d = jax.eval_shape(fp4.nvfp4_quantize, w)
    assert ledger({"w": one_d}).param_bytes == n // 2 + n // 16 + 4  # 4.5 bits/value
    assert ledger({"w": mx}).param_bytes == n // 2 + n // 32 + 4  # 4.25 bits (+ a unit f32)
    # A bare E2M1 array is packed too; gradients and Adam's moments take the full f32 shape.
    assert ledger({"w": jax.ShapeDtypeStruct((3, 5), jnp.float4_e2m1fn)}
                         ).param_bytes == 8  # ceil(15 / 2)
    led = ledger({"w": one_d}, optax.adam(1e-3))
    assert led.grad_bytes == 4 * n and led.opt_state_bytes == 8 * n
