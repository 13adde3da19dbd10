"""The emulated limited-precision accumulator and its promotion into f32."""

import jax
import jax.numpy as jnp
import numpy as np

from fmtkit import fp8


def test_accumulation_emulation_promotion_matters():
    """Limited accumulation (13 mantissa bits) over K = 4096: promotion every 128 recovers."""
    k1, k2 = jax.random.split(jax.random.key(5))
    a = jax.random.uniform(k1, (8, 4096), jnp.float32)  # positive: errors do not cancel
    b = jax.random.uniform(k2, (8, 4096), jnp.float32)
    a8 = a.astype(jnp.float8_e4m3fn).astype(jnp.float32)
    b8 = b.astype(jnp.float8_e4m3fn).astype(jnp.float32)
    ref = np.asarray(a8, np.float64) @ np.asarray(b8, np.float64).T
    no_promo = fp8.limited_precision_matmul(a8, b8, mantissa_bits=13, promote_every=None)
    promo = fp8.limited_precision_matmul(a8, b8, mantissa_bits=13, promote_every=128)
    rel = lambda y: np.abs(np.asarray(y, np.float64) - ref).max() / np.abs(ref).max()  # noqa: E731
    # Truncating a sum near 1000 to 13 bits drops up to 2^(10-13) = 0.125 per add: large.
    assert rel(no_promo) > 1e-3
    assert rel(promo) < rel(no_promo) / 4
