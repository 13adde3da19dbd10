"""The public surface is explicit (STYLE.md rule 1): nothing leaks in by accident."""

import fmtkit

EXPECTED = {
    "FORMATS", "AxisScaling", "BlockScaling", "Decomposition", "DelayedScaling",
    "DelayedScalingState", "Format", "MXScaling", "ScaledArray", "TensorScaling", "cast",
    "decompose", "dequantize", "get_format", "qdq", "quantize", "telemetry",
}


def test_all_is_the_contract():
    assert set(fmtkit.__all__) == EXPECTED
    for name in EXPECTED:
        assert hasattr(fmtkit, name)
