"""The one place that chooses the GPU backend for the kernels in this package.

Every kernel here is written for Mosaic GPU (``jax.experimental.pallas.mosaic_gpu``) and
launched with ``plgpu.kernel``: it has FP8 ``wgmma`` and the warp-specialized pipeline; the
Pallas Triton backend is deprecated since jax 0.11 and rejects mixed FP8 dots. Kernel
modules import ``plgpu`` from here and ask this module
which implementation to run:

* ``"kernel"``: the compiled Mosaic GPU kernel (needs a Hopper GPU at run time; lowering
  also works on CPU under an abstract H200 mesh, which is how the tests check it);
* ``"interpret"``: the same kernel under Mosaic GPU's interpreter
  (``plgpu.InterpretGPUParams()``), which runs on CPU: slow, for tests. Passing a
  ``plgpu.InterpretGPUParams`` instance instead of the string picks its options (e.g.
  ``detect_races=True``);
* ``"reference"``: the pure-JAX reference, which runs anywhere.

``impl="auto"`` picks ``"kernel"`` on a Hopper GPU (compute capability 9.x, or an abstract
device whose kind names a Hopper part) and ``"reference"`` elsewhere: CPU, older GPUs, and
Blackwell, whose tensor cores need ``tcgen05`` rather than ``wgmma``.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

__all__ = ["IMPLS", "Impl", "interpret_params", "is_hopper", "num_sms", "pl", "plgpu",
           "resolve_impl"]

Impl = Literal["auto", "kernel", "interpret", "reference"] | plgpu.InterpretGPUParams
IMPLS = ("auto", "kernel", "interpret", "reference")
Resolved = Literal["kernel", "interpret", "reference"]

# Hopper (sm_90) parts; device_kind strings as CUDA reports them ("NVIDIA H200", ...).
_HOPPER_KINDS = ("H100", "H200", "H800", "H20", "GH200")
# H100/H200 SXM have 132 SMs (NVIDIA Hopper tuning guide); used when no device tells us.
_DEFAULT_NUM_SMS = 132
# Programs launched in interpret mode: two, so the persistent loop visits several output
# tiles per program without simulating 132 programs one after another on the CPU.
_INTERPRET_NUM_SMS = 2


def _abstract_device():
    mesh = jax.sharding.get_abstract_mesh()
    return getattr(mesh, "abstract_device", None)


def is_hopper() -> bool:
    """True if the kernels would run compiled here: an abstract or real Hopper GPU."""
    dev = _abstract_device()
    if dev is not None:
        return dev.platform == "gpu" and any(k in dev.device_kind for k in _HOPPER_KINDS)
    if jax.default_backend() != "gpu":
        return False
    d = jax.devices()[0]
    cc = getattr(d, "compute_capability", None)
    if cc is not None:
        return str(cc).split(".")[0] == "9"
    return any(k in getattr(d, "device_kind", "") for k in _HOPPER_KINDS)


def resolve_impl(impl: Impl) -> Resolved:
    """Maps the user's ``impl`` to the implementation that will run (see module doc).

    Raises:
      ValueError: ``impl`` is neither one of ``IMPLS`` nor a ``plgpu.InterpretGPUParams``.
    """
    if isinstance(impl, plgpu.InterpretGPUParams):
        return "interpret"
    if impl not in IMPLS:
        raise ValueError(
            f"impl must be one of {IMPLS} or a plgpu.InterpretGPUParams, got {impl!r}.")
    if impl == "auto":
        return "kernel" if is_hopper() else "reference"
    return impl  # type: ignore[return-value]


def interpret_params(impl: Impl) -> plgpu.InterpretGPUParams | None:
    """The ``interpret=`` argument for ``plgpu.kernel`` (None: compile for the GPU)."""
    if isinstance(impl, plgpu.InterpretGPUParams):
        return impl
    return plgpu.InterpretGPUParams() if resolve_impl(impl) == "interpret" else None


def num_sms(impl: Impl) -> int:
    """Programs of a persistent kernel: the GPU's SM count (2 in interpret mode)."""
    if resolve_impl(impl) == "interpret":
        return _INTERPRET_NUM_SMS
    dev = _abstract_device()
    if dev is not None and getattr(dev, "num_cores", None):
        return int(dev.num_cores)
    if jax.default_backend() == "gpu":
        count = getattr(jax.devices()[0], "core_count", None)
        if count:
            return int(count)
    return _DEFAULT_NUM_SMS
