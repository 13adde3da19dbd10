"""Groundwork for MXFP8 on Blackwell: JAX's native block-scaled dot.

``jax.nn.scaled_matmul`` takes MXFP8 operands (e4m3 values, one e8m0 scale per 32 of K) in
exactly the layout ``fmtkit.quantize(x, "e4m3", MXScaling(32))`` produces (values
``[M, K]``, scales ``[M, K/32]``, ``x ≈ values * scale``), so the "mxfp8" recipe can hand its
operands over as they are. On CUDA it lowers to XLA's ``__op$block_scaled_dot`` custom call,
which XLA GPU runs as cuDNN's block-scaled GEMM on Blackwell (sm_100) and decomposes on older
GPUs; on CPU it decomposes. What can be checked without a GPU: the semantics (CPU) and the
lowering for a Blackwell target. Whether XLA picks the fused cuDNN kernel is decided when it
compiles for an sm_100 device, which no test here can do.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fmtkit.scaling import MXScaling, quantize
from pallas_kernels import _backend

B200 = jax.sharding.AbstractDevice(device_kind="NVIDIA B200", platform="gpu", num_cores=148)


def _mx(x):
    sa = quantize(x, "e4m3", MXScaling(block=32))
    return sa.values, sa.scale


def test_scaled_matmul_takes_fmtkits_mx_layout():
    """On CPU: the native dot of fmtkit's MX operands equals the float64 product of the
    dequantized operands (up to f32 accumulation)."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((64, 256)) * 2.0 ** rng.integers(-8, 8, (64, 256)),
                    jnp.float32)
    w = jnp.asarray(rng.standard_normal((96, 256)), jnp.float32)
    (xv, xs), (wv, ws) = _mx(x), _mx(w)
    assert xs.dtype == jnp.float8_e8m0fnu and xs.shape == (64, 256 // 32)
    out = jax.nn.scaled_matmul(xv[None], wv[None], xs[None], ws[None],
                               preferred_element_type=jnp.float32)[0]

    def deq(v, s):
        return (np.asarray(v, np.float64)
                * np.repeat(np.asarray(s.astype(jnp.float32), np.float64), 32, axis=1))

    want = deq(xv, xs) @ deq(wv, ws).T
    err = np.linalg.norm(np.asarray(out, np.float64) - want) / np.linalg.norm(want)
    assert err < 1e-6  # exact products, f32 sums of 256 terms


def test_mxfp8_native_dot_lowers_for_blackwell():
    args = (jax.ShapeDtypeStruct((1, 4096, 7168), jnp.float8_e4m3fn),
            jax.ShapeDtypeStruct((1, 2048, 7168), jnp.float8_e4m3fn),
            jax.ShapeDtypeStruct((1, 4096, 7168 // 32), jnp.float8_e8m0fnu),
            jax.ShapeDtypeStruct((1, 2048, 7168 // 32), jnp.float8_e8m0fnu))
    mesh = jax.sharding.AbstractMesh((), (), abstract_device=B200)
    with jax.sharding.use_abstract_mesh(mesh):
        assert _backend.resolve_impl("auto") == "reference"  # no wgmma on Blackwell
        text = jax.jit(lambda a, b, sa, sb: jax.nn.scaled_matmul(
            a, b, sa, sb, preferred_element_type=jnp.bfloat16)).trace(*args).lower(
                lowering_platforms=("cuda",)).as_text()
    assert "__op$block_scaled_dot" in text


def _is_blackwell() -> bool:
    if jax.default_backend() != "gpu":
        return False
    return str(getattr(jax.devices()[0], "compute_capability", "")).startswith("10")


@pytest.mark.gpu
@pytest.mark.skipif(not _is_blackwell(),
                    reason="needs a Blackwell GPU: whether XLA runs __op$block_scaled_dot as "
                           "cuDNN's fused MXFP8 GEMM is decided when compiling for sm_100")
def test_mxfp8_native_dot_is_fused_on_blackwell():
    """On a B200: the compiled module calls cuDNN for the block-scaled dot (the custom call
    is rewritten, not decomposed into a dequantize and a bf16/f32 dot), and the result
    matches the CPU-checked semantics above. The cuDNN target's exact name is not known
    here (no Blackwell to look at): the check is that the generic op is gone and cuDNN
    appears."""
    x = jax.random.normal(jax.random.key(0), (256, 512), jnp.float32)
    w = jax.random.normal(jax.random.key(1), (384, 512), jnp.float32)
    (xv, xs), (wv, ws) = _mx(x), _mx(w)
    fn = jax.jit(lambda a, b, sa, sb: jax.nn.scaled_matmul(a, b, sa, sb))
    hlo = fn.lower(xv[None], wv[None], xs[None], ws[None]).compile().as_text()
    assert "__op$block_scaled_dot" not in hlo and "cudnn" in hlo.lower()
