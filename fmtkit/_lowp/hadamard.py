"""The random Hadamard transform of the FP4 weight gradient (arXiv 2509.25149 section 4.2,
appendix C; Transformer Engine ``hadamard.py``): see ``fmtkit.fp4``'s module docstring, the
public path of these names."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from fmtkit.casting import check_floating


@functools.cache
def hadamard_matrix(n: int = 16) -> np.ndarray:
    """The n x n Sylvester Hadamard matrix divided by sqrt(n) (orthogonal), float64.

    Raises:
      ValueError: n not a power of two >= 2.

    Example:
      >>> h = hadamard_matrix(4)                  # orthonormal: h @ h.T is the identity
      >>> bool(np.allclose(h @ h.T, np.eye(4)))
      True
    """
    if not isinstance(n, int) or n < 2 or n & (n - 1):
        raise ValueError(f"n must be a power of two >= 2, got {n!r}.")
    h = np.array([[1.0]])
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h / math.sqrt(n)


@functools.cache
def rht_matrix(seed: int = 0, n: int = 16) -> np.ndarray:
    """``R = diag(s) H_n / sqrt(n)`` with a sign vector ``s`` drawn from ``seed`` (NumPy's
    PCG64, stable across platforms and releases), float64 [n, n]; ``R Rᵀ = I``.

    Example:
      >>> r = rht_matrix(seed=0, n=16)            # random signs, still orthonormal
      >>> r.shape, bool(np.allclose(r @ r.T, np.eye(16), atol=1e-6))
      ((16, 16), True)
    """
    return _rht_signs(seed, n)[:, None] * hadamard_matrix(n)


def _rht_signs(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).choice(np.array([-1.0, 1.0]), size=n)


def random_hadamard_transform(t: jax.typing.ArrayLike, *, seed: int = 0,
                              size: int = 16) -> jax.Array:
    """``t`` rotated by ``rht_matrix(seed, size)`` in each ``size``-wide tile of its last axis
    (computed in f32, returned in f32).

    Applied to both operands of a product along their shared (contracted) last axis, it
    cancels: ``rht(a) @ rht(b).T == a @ b.T`` up to rounding.

    Raises:
      ValueError: the last dim is not a multiple of ``size``.

    Example:
      >>> t = jnp.ones((2, 16))
      >>> y = random_hadamard_transform(t)            # an orthonormal rotation: norms kept
      >>> bool(jnp.allclose(jnp.linalg.norm(y, axis=-1), jnp.linalg.norm(t, axis=-1)))
      True
    """
    t = check_floating(t, "t")
    if t.ndim == 0 or t.shape[-1] % size:
        raise ValueError(f"t's last dim ({t.shape[-1:] or 'scalar'}) must be a multiple of "
                         f"size={size}.")
    hadamard_matrix(size)  # validates size
    signs = jnp.asarray(_rht_signs(seed, size), jnp.float32)
    lead = t.shape[:-1]
    v = t.astype(jnp.float32).reshape(*lead, t.shape[-1] // size, size)
    v = v * signs.reshape((1,) * (v.ndim - 1) + (size,))
    # Fast Walsh-Hadamard transform: log2(size) butterfly stages (I ⊗ H2 ⊗ I_h for h = 1, 2,
    # 4, ...; their product is Sylvester's H), adds and subtracts, so no matmul appears in
    # the jaxpr besides the GEMMs (what TE's kernels do too), then the exact 1 / sqrt(size).
    h = 1
    while h < size:
        b = v.reshape(*lead, -1, size // (2 * h), 2, h)
        v = jnp.stack([b[..., 0, :] + b[..., 1, :], b[..., 0, :] - b[..., 1, :]], axis=-2)
        h *= 2
    return (v.reshape(t.shape) * jnp.float32(1.0 / math.sqrt(size))).astype(jnp.float32)
