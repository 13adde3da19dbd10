"""Uses every deprecated spelling twice in a fresh interpreter; prints one JSON line
``{use: [{"same": bool, "warnings": ["Category: message", ...]}, (second use)]}``.

Run by tests/test_deprecated.py in its own process, so that each use is the process's first
(module caches and once-only warning registries start empty) without patching anything.
"""

import importlib
import json
import sys
import warnings

import jax.numpy as jnp

import fmtkit
from fmtkit import fp4, fp8, policy
from fmtkit.debug import log
from fmtkit.telemetry import cast_stats

# What the uses read, made before any use is recorded (loading Flax for the NNX Variable).
VARIABLE = policy.DelayedScalingVariable
STATS = cast_stats(jnp.array([1e-8, 1.0, 7e4, jnp.inf], jnp.float32), "fp16")
QSTATS = fp4.quantization_stats(jnp.linspace(-3.0, 3.0, 16 * 32, dtype=jnp.float32
                                             ).reshape(16, 32), "nvfp4", "x")


def _debuglog() -> bool:
    old = importlib.import_module("fmtkit.debuglog")
    return old.__all__ == log.__all__ and all(getattr(old, n) is getattr(log, n)
                                              for n in log.__all__)


USES = {
    "fmtkit.fp8.FP8Recipe": lambda: fp8.FP8Recipe is fp8.Fp8Recipe,
    "fmtkit.fp8.dot_general(recipe)": lambda: (
        fp8.dot_general("current").recipe == fp8.dot_general_fn("current").recipe),
    "fmtkit.fp8.Fp8DotState": lambda: fp8.Fp8DotState is fmtkit.DelayedScalingState,
    "fmtkit.policy.Fp8State": lambda: policy.Fp8State is VARIABLE,
    "fmtkit.debuglog": _debuglog,
    "NumericsStats.underflow": lambda: STATS.underflow is STATS.underflow_share,
    "NumericsStats.overflow": lambda: STATS.overflow is STATS.overflow_share,
    "NumericsStats.nonfinite": lambda: STATS.nonfinite is STATS.nonfinite_share,
    "saturated_blocks": lambda: QSTATS["saturated_blocks"] is QSTATS["saturation_block_share"],
    "underflow_blocks": lambda: QSTATS["underflow_blocks"] is QSTATS["underflow_block_share"],
    "zero_fraction": lambda: QSTATS["zero_fraction"] is QSTATS["underflow_share"],
}


def main() -> None:
    assert "fmtkit.debuglog" not in sys.modules
    out = {}
    for name, use in USES.items():
        runs = []
        for _ in range(2):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                same = bool(use())
            runs.append({"same": same, "warnings": [f"{w.category.__name__}: {w.message}"
                                                    for w in caught]})
        out[name] = runs
    print(json.dumps(out))


if __name__ == "__main__":
    main()
