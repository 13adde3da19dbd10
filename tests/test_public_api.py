"""The public surface is explicit: nothing leaks in by accident."""

import fmtkit

EXPECTED = {
    "FORMATS", "AxisScaling", "BlockScaling", "Decomposition", "DelayedScaling",
    "DelayedScalingState", "Format", "MXScaling", "ScaledArray", "TensorScaling", "cast",
    "decompose", "dequantize", "get_format", "qdq", "quantize", "telemetry",
    "Policy", "Rules", "with_policy", "module_paths", "inspect_policy", "list_presets",
    "get_preset", "fp4", "fp8", "optim", "memory", "distributed",
}


def test_importing_fmtkit_does_not_import_flax():
    import subprocess
    import sys

    code = "import sys, fmtkit; print('flax' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_all_is_the_contract():
    assert set(fmtkit.__all__) == EXPECTED
    for name in EXPECTED:
        assert hasattr(fmtkit, name)
