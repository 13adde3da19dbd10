"""Shared fixtures of the kernel tests.

``mode`` parametrizes one test body over the kernel in GPU-interpret mode (runs on CPU) and
compiled (needs a Hopper GPU): the GPU mark and skip sit on the compiled parameter only, so
the interpret half always runs and the compiled half is visibly skipped, never silently
absent.
"""

import pytest

from pallas_kernels import _backend

_HAS_HOPPER = _backend.is_hopper()

KERNEL_MODES = [
    pytest.param("interpret", id="interpret"),
    pytest.param(
        "kernel",
        id="compiled",
        marks=[pytest.mark.gpu,
               pytest.mark.skipif(not _HAS_HOPPER, reason="needs a Hopper (sm_90) GPU")],
    ),
]


@pytest.fixture(params=KERNEL_MODES)
def mode(request) -> str:
    """The ``impl`` of the kernel under test: "interpret" or "kernel" (compiled)."""
    return request.param
