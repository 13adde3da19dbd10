"""GEMM backends: kernels that register themselves for ``Fp8Recipe.use_kernel`` "auto" and
"interpret" (``pallas_kernels`` does on import; JAX's native block-scaled dot is registered
here), the choice of a backend for one GEMM, and where a trace runs (GPU, Blackwell)."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from fmtkit._lowp.recipes import Fp8Recipe
from fmtkit.scaling import ScaledArray


class GemmBackend(NamedTuple):
    """A GEMM kernel for quantized operands (see ``register_gemm_backend``)."""

    name: str
    fn: Callable[..., jax.Array]
    applies: Callable[[ScaledArray, ScaledArray], bool]
    available: Callable[[], bool]
    ragged: Callable[..., jax.Array] | None = None
    ragged_wgrad: Callable[..., jax.Array] | None = None


_GEMM_BACKENDS: dict[str, GemmBackend] = {}
_ENTRY_POINT_GROUP = "fmtkit.gemm_backends"
_entry_points_loaded = False


def register_gemm_backend(name: str, fn: Callable[..., jax.Array], *,
                          applies: Callable[[ScaledArray, ScaledArray], bool],
                          available: Callable[[], bool],
                          ragged: Callable[..., jax.Array] | None = None,
                          ragged_wgrad: Callable[..., jax.Array] | None = None) -> None:
    """Registers a GEMM kernel for ``Fp8Recipe.use_kernel`` "auto" / "interpret".

    Args:
      name: the backend's name (registering a name again replaces it).
      fn: ``fn(a_values, a_scale, b_values, b_scale, *, impl, out_dtype) -> [F1, F2]``,
        the product ``a [F1, C] · b [F2, C]ᵀ`` with the scales applied per block of C,
        exactly ``scaled_matmul``'s semantics, accumulated in f32 and rounded once to
        ``out_dtype`` (float32, or bfloat16 where the GEMM's consumer is bf16: the forward
        and data-gradient GEMMs of a bf16 model; a kernel that writes bf16 moves half the
        output bytes); ``impl`` is "kernel" or "interpret".
      applies: whether the kernel takes these two (padded) ``ScaledArray`` operands.
      available: whether the compiled kernel runs here (e.g. on a Hopper GPU); evaluated at
        trace time, so an abstract mesh's device counts.
      ragged: optional grouped GEMM for ``fmtkit.fp8.ragged_dot``'s forward and data
        gradient: ``ragged(a_values, a_scale, b_values, b_scale, group_sizes, *, impl,
        out_dtype) -> [M, F]``, row m of ``a [M, C]`` times ``b[g(m)] [F, C]ᵀ`` of the stack
        ``b [G, F, C]`` (scales ``[G, F/bf, C/bc]``), rows in groups of ``group_sizes``
        (int32 ``[G]``), zeros past their sum; ``applies`` is asked about ``a`` and one
        group of ``b``.
      ragged_wgrad: optional grouped weight-gradient GEMM: ``ragged_wgrad(a_values,
        a_scale, b_values, b_scale, group_blocks, *, impl, out_dtype) -> [G, F1, F2]``,
        per group ``a[:, T_g] · b[:, T_g]ᵀ`` of ``a [F1, T]``, ``b [F2, T]`` (tokens minor,
        scales per token block) over the group's token blocks, ``group_blocks`` int32
        ``[2, G]`` (first block and count: ``expert_block_layout``).

    ``fmtkit`` never imports a kernel package by name: ``pallas_kernels`` calls this when it
    is imported, and "auto" also loads the packages that declare the entry-point group
    ``fmtkit.gemm_backends`` (this repository's ``pyproject.toml`` declares
    ``pallas_kernels``), so on a Hopper GPU "auto" finds the kernel without an import.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty string, got {name!r}.")
    for arg, f in (("fn", fn), ("applies", applies), ("available", available)):
        if not callable(f):
            raise TypeError(f"{arg} must be callable, got {f!r}.")
    for arg, f in (("ragged", ragged), ("ragged_wgrad", ragged_wgrad)):
        if f is not None and not callable(f):
            raise TypeError(f"{arg} must be callable or None, got {f!r}.")
    _GEMM_BACKENDS[name] = GemmBackend(name, fn, applies, available, ragged, ragged_wgrad)


def gemm_backends() -> dict[str, GemmBackend]:
    """The registered GEMM backends, after loading the ``fmtkit.gemm_backends`` entry points."""
    global _entry_points_loaded
    if not _entry_points_loaded:
        _entry_points_loaded = True
        import importlib.metadata

        for ep in importlib.metadata.entry_points(group=_ENTRY_POINT_GROUP):
            try:
                ep.load()
            except ImportError:  # an optional kernel package whose dependencies are missing
                continue
    return dict(_GEMM_BACKENDS)


def kernel_backend(recipe: Fp8Recipe, a: ScaledArray, b: ScaledArray, form: str = "fn"
                   ) -> tuple[GemmBackend, str] | None:
    """The registered kernel and its ``impl`` for this GEMM, or None for ``scaled_matmul``;
    ``form``: the backend's field that must be set ("fn", "ragged", "ragged_wgrad")."""
    if recipe.use_kernel == "never" or recipe.accum_mantissa_bits is not None:
        return None
    if recipe.use_kernel == "auto" and not on_gpu():
        return None  # no kernel package is loaded where none could run compiled
    backends = gemm_backends()
    for backend in backends.values():
        if getattr(backend, form) is None or not backend.applies(a, b):
            continue
        if recipe.use_kernel == "interpret":
            return backend, "interpret"
        if backend.available():
            return backend, "kernel"
    if recipe.use_kernel == "auto" and _is_blockwise(a, b) and set(backends) <= _BUILT_IN:
        _warn_no_kernel_package(recipe)
    return None


_BUILT_IN = frozenset({"jax_block_scaled_dot"})
_warned_no_kernel: set[str] = set()


def _is_blockwise(a: ScaledArray, b: ScaledArray) -> bool:
    """DeepSeek-V3's tiling (1x128 activations, 128x128 or 1x128 weights): the GEMMs a
    Hopper kernel package serves."""
    return a.block == (1, 128) and b.block in ((128, 128), (1, 128))


def _warn_no_kernel_package(recipe: Fp8Recipe) -> None:
    """Once per recipe name: on a GPU, blockwise GEMMs found no kernel package at all (the
    entry point that registers ``pallas_kernels`` exists only once the project is installed),
    so they run emulated, several times slower than a kernel."""
    if recipe.name in _warned_no_kernel:
        return
    _warned_no_kernel.add(recipe.name)
    warnings.warn(
        f"FP8 recipe {recipe.name!r} (use_kernel='auto') runs its blockwise GEMMs emulated on "
        "this GPU: no GEMM kernel package is registered. Install the project (pip install -e "
        "., whose entry point registers pallas_kernels) or import pallas_kernels before "
        "tracing; use_kernel='never' silences this.", UserWarning, stacklevel=2)


# Blackwell parts (compute capability 10.x), whose tensor cores take MX block scales.
_BLACKWELL_KINDS = ("B100", "B200", "B300", "GB200", "GB300")
_MX_ELEMENTS = ("float8_e4m3fn", "float8_e5m2")


def on_blackwell() -> bool:
    """Whether this trace targets a Blackwell GPU (block-scaled tensor cores): an abstract
    mesh's device (cross-lowering without one), else the default device."""
    device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
    if device is None:
        if jax.default_backend() != "gpu":
            return False
        device = jax.devices()[0]
        cc = getattr(device, "compute_capability", None)
        if cc is not None:
            return str(cc).split(".")[0] == "10"
    return device.platform == "gpu" and any(
        k in getattr(device, "device_kind", "") for k in _BLACKWELL_KINDS)


def _fits_block_scaled_dot(a: ScaledArray, b: ScaledArray) -> bool:
    """MXFP8 operands: E4M3/E5M2 elements in 1x32 blocks along C with E8M0 scales."""
    return all(t.block == (1, 32) and t.fmt.name in _MX_ELEMENTS
               and t.scale.dtype == jnp.float8_e8m0fnu for t in (a, b))


def _block_scaled_dot(a_values, a_scale, b_values, b_scale, *, impl, out_dtype):
    """JAX's native block-scaled dot (``jax.nn.scaled_matmul``): XLA's ``block_scaled_dot``,
    run by cuDNN on Blackwell; elsewhere (``impl="interpret"``) JAX's own decomposition."""
    del impl
    return jax.nn.scaled_matmul(a_values[None], b_values[None], a_scale[None], b_scale[None],
                                preferred_element_type=jnp.float32)[0].astype(out_dtype)


register_gemm_backend("jax_block_scaled_dot", _block_scaled_dot,
                      applies=_fits_block_scaled_dot, available=on_blackwell)


def on_gpu() -> bool:
    """Whether this trace targets a GPU (an abstract mesh's device, else the default one)."""
    device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
    if device is not None:
        return device.platform == "gpu"
    return jax.default_backend() == "gpu"

