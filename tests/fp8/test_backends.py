"""GEMM backends: the registry, the Pallas kernel package and JAX's native block-scaled dot
(MXFP8 on Blackwell).
"""

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fp8_testlib import data, fwd_bwd, reference_gemms

from fmtkit import fp8
from fmtkit._lowp import backends, gemm
from fmtkit.formats import get_format
from fmtkit.scaling import ScaledArray


def test_blockwise_reaches_the_pallas_kernel_for_all_three_gemms():
    """Guard: with the kernel requested, forward, dgrad and wgrad run the Pallas kernel
    (GPU-interpret mode on CPU) and agree with the pure-JAX path to f32 round-off."""
    import pallas_kernels  # noqa: F401  (importing it registers the kernel backend)

    recipe = dataclasses.replace(fp8.RECIPES["blockwise"], use_kernel="interpret")
    x, w, dy = data(128, 256, 128)
    kernel_fn = lambda a, b, g: fwd_bwd(recipe, a, b, g)  # noqa: E731
    text = str(jax.make_jaxpr(kernel_fn)(x, w, dy))
    assert text.count("blockwise_fp8_matmul") >= 3
    assert "blockwise_fp8_matmul" not in str(jax.make_jaxpr(
        lambda a, b, g: fwd_bwd("blockwise", a, b, g))(x, w, dy))  # CPU: the JAX path
    got = kernel_fn(x, w, dy)
    ref = fwd_bwd("blockwise", x, w, dy)
    for g_, r_ in zip(got, ref):
        np.testing.assert_allclose(np.asarray(g_), np.asarray(r_), rtol=1e-5, atol=1e-5)


def test_fp8_never_imports_a_kernel_package():
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(fp8))
    names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    names += [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert not [n for n in names if n and n.startswith("pallas_kernels")], names


def test_registered_backend_is_used_when_it_applies():
    calls = []

    def fake(a, a_scale, b, b_scale, *, impl, out_dtype):
        calls.append(impl)
        return fp8.scaled_matmul(
            ScaledArray(a, a_scale, get_format("e4m3"), None),
            ScaledArray(b, b_scale, get_format("e4m3"), None)).astype(out_dtype)

    saved = dict(backends._GEMM_BACKENDS)
    try:
        backends._GEMM_BACKENDS.clear()  # only the fake (pallas_kernels may be registered)
        fp8.register_gemm_backend("fake", fake, applies=lambda a, b: a.block == (1, 128),
                                  available=lambda: False)
        x, w, dy = data(128, 256, 128)
        interp = dataclasses.replace(fp8.RECIPES["blockwise"], use_kernel="interpret")
        got = fwd_bwd(interp, x, w, dy)
        assert calls == ["interpret"] * 3
        ref = fwd_bwd("blockwise", x, w, dy)  # "auto": registered, but not available here
        assert calls == ["interpret"] * 3
        for g_, r_ in zip(got, ref):
            np.testing.assert_allclose(np.asarray(g_), np.asarray(r_), rtol=1e-6, atol=1e-6)
        with pytest.raises(TypeError, match="applies must be callable"):
            fp8.register_gemm_backend("bad", fake, applies=None, available=lambda: True)
    finally:
        backends._GEMM_BACKENDS.clear()
        backends._GEMM_BACKENDS.update(saved)


def test_blockwise_on_a_gpu_without_a_kernel_package_warns_once(monkeypatch):
    """A GPU trace whose blockwise GEMMs find no kernel package (a checkout that is not
    installed has no entry point) says it runs them emulated, once; the result is the
    emulated GEMM's; with a package registered, or use_kernel="never", nothing is said."""
    x, w, dy = data(128, 256, 128)
    ref = fwd_bwd("blockwise", x, w, dy)
    monkeypatch.setattr(backends, "_entry_points_loaded", True)
    monkeypatch.setattr(backends, "_GEMM_BACKENDS", {
        k: v for k, v in backends._GEMM_BACKENDS.items() if k in backends._BUILT_IN})
    monkeypatch.setattr(backends, "_warned_no_kernel", set())
    for mod in (gemm, backends):
        monkeypatch.setattr(mod, "on_gpu", lambda: True)
    with pytest.warns(UserWarning, match=r"'blockwise' .* runs its blockwise GEMMs emulated"):
        got = fwd_bwd("blockwise", x, w, dy)
    for g_, r_ in zip(got, ref):  # the GPU path's operand layout: another f32 summation order
        np.testing.assert_allclose(np.asarray(g_), np.asarray(r_), rtol=1e-6, atol=1e-6)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fwd_bwd("blockwise", x, w, dy)  # once per recipe
        fwd_bwd(dataclasses.replace(fp8.RECIPES["current"], name="current2"), x, w, dy)
        fwd_bwd(dataclasses.replace(fp8.RECIPES["blockwise"], name="b2", use_kernel="never"),
                 x, w, dy)
        fp8.register_gemm_backend("other", lambda *a, **k: None, applies=lambda a, b: False,
                                  available=lambda: False)
        fwd_bwd(dataclasses.replace(fp8.RECIPES["blockwise"], name="b3"), x, w, dy)


# ---------------------------------------------------------------------------------------------
# MXFP8 on Blackwell: JAX's native block-scaled dot as a GEMM backend.


def _lower_for(kind, fn, *args):
    dev = jax.sharding.AbstractDevice(device_kind=kind, platform="gpu", num_cores=132)
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=dev)):
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def test_mxfp8_uses_the_native_block_scaled_dot_on_blackwell_only():
    x, w, dy = (jax.ShapeDtypeStruct(a.shape, jnp.bfloat16) for a in data(128, 256, 64))
    fn = lambda a, b, g: fwd_bwd("mxfp8", a, b, g)  # noqa: E731
    assert _lower_for("NVIDIA B200", fn, x, w, dy).count("block_scaled_dot") == 3
    assert "block_scaled_dot" not in _lower_for("NVIDIA H200", fn, x, w, dy)


def test_block_scaled_dot_equals_the_emulated_mxfp8_gemms():
    """The backend off Blackwell (JAX's decomposition) against the pure-JAX path: the same
    quantized operands and f32 accumulation, so equal up to f32 summation order."""
    x, w, dy = data(128, 200, 72)  # padded to 224 along K: the backend sees padded operands
    native = dataclasses.replace(fp8.RECIPES["mxfp8"], use_kernel="interpret")
    got = jax.jit(lambda a, b, g: fwd_bwd(native, a, b, g))(x, w, dy)
    text = str(jax.make_jaxpr(lambda a, b, g: fwd_bwd(native, a, b, g))(x, w, dy))
    assert "scaled_matmul" in text or "block_scaled" in text
    plain = str(jax.make_jaxpr(lambda a, b, g: fwd_bwd("mxfp8", a, b, g))(x, w, dy))
    assert "scaled_matmul" not in plain and "block_scaled" not in plain  # CPU: the JAX path
    for g_, ref in zip(got, reference_gemms("mxfp8", x, w, dy)):
        np.testing.assert_allclose(np.asarray(g_, np.float64), ref, rtol=1e-5,
                                   atol=1e-5 * np.abs(ref).max())
