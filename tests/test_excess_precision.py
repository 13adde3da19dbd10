"""XLA must round every bf16/f16 intermediate (no "excess precision") in the tests (the CLI's
flag: tests/studies/test_cli.py)."""

import jax
import jax.numpy as jnp


def test_bf16_sum_is_rounded_under_jit():
    f = jax.jit(lambda a, b: (a + b).astype(jnp.float32))
    # 1 + 1e-3 in bf16 (8 significant bits) rounds back to 1.0 (spacing 2^-7).
    assert float(f(jnp.bfloat16(1.0), jnp.bfloat16(1e-3))) == 1.0
    assert float(f(jnp.float16(1.0), jnp.float16(1e-4))) == 1.0  # fp16 spacing 2^-10

