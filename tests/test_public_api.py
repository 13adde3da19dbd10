"""The public surface is explicit: nothing leaks in by accident, and nothing public leaves
without a deprecation."""

import importlib
import warnings

import pytest

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

    # Nor qwix (the optional dependency of fmtkit.qwix, imported only with that module).
    code = "import sys, fmtkit; print('flax' in sys.modules, 'qwix' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False False"


def test_all_is_the_contract():
    assert set(fmtkit.__all__) == EXPECTED
    for name in EXPECTED:
        assert hasattr(fmtkit, name)


# Every public name (the __all__ of each public module) as of the split of fmtkit.fp8 into a
# package, written out: a later removal or move fails here. Names that are deprecated since
# then still import, and warn (DEPRECATED: the name and what its warning names instead).
PUBLIC_NAMES: dict[str, tuple[str, ...]] = {
    "fmtkit": (
        "AxisScaling", "BlockScaling", "Decomposition", "DelayedScaling",
        "DelayedScalingState", "FORMATS", "Format", "MXScaling", "Policy", "Rules",
        "ScaledArray", "TensorScaling", "cast", "decompose", "dequantize", "distributed", "fp4",
        "fp8", "get_format", "get_preset", "inspect_policy", "list_presets", "memory",
        "module_paths", "optim", "qdq", "quantize", "telemetry", "with_policy"),
    "fmtkit.fp8": (
        "FP8Recipe", "Fp8DotState", "Fp8Recipe", "GemmBackend", "PARTIALS_BUDGET_BYTES",
        "RECIPES", "combine_observations", "dot_general", "dot_general_fn", "gemm_backends",
        "get_recipe", "init_state", "limited_precision_matmul", "register_gemm_backend",
        "scaled_matmul", "update_state",
        # not in __all__, but imported by name by the policy layer and jaxpr readers
        "WIDENED_SCOPE", "DGRAD_SCOPE", "WGRAD_SCOPE", "on_blackwell"),
    "fmtkit.fp4": (
        "Fp4Array", "Fp4Recipe", "RECIPES", "dequantize", "dot_general_fn", "get_recipe",
        "hadamard_matrix", "mxfp4_quantize", "nvfp4_quantize", "quantization_stats",
        "random_hadamard_transform", "rht_matrix", "GEMM_SCOPE"),
    "fmtkit.policy": (
        "DelayedScalingVariable", "Fp8State", "GemmSite", "MatmulOp", "ModuleReport", "Policy",
        "PolicyReport", "Rules", "as_rules",
        "describe_presets", "find_stack", "get_preset", "inspect_policy", "intercept_gemms",
        "keep_blocks", "list_presets", "mark_head", "module_paths", "with_policy"),
    "fmtkit.debug": (
        "BASE_STATS", "OVERRIDES", "QUANT_STATS", "STATS", "TENSORS", "DebugConfig", "Rule",
        "capture", "init"),
    "fmtkit.optim": (
        "DynamicLossScaleState", "KahanUpdatesState", "MasterWeightsState", "ScaleByAdamState",
        "StaticLossScaleState", "StochasticRoundUpdatesState", "adam", "adamw", "add_updates",
        "all_finite", "dynamic_loss_scale", "kahan_updates", "loss_scale", "master_weights",
        "multi_steps", "param_mismatches", "scale_by_adam", "scale_loss", "static_loss_scale",
        "stochastic_round_updates", "unscale_grads"),
    "fmtkit.scaling": (
        "AxisScaling", "BlockScaling", "DelayedScaling", "DelayedScalingState", "MXScaling",
        "Recipe", "ScaledArray", "TensorScaling", "compute_scale", "delayed_amax",
        "delayed_amax_of", "dequantize", "keep_nonfinite", "qdq", "quantize", "record_amax"),
    "fmtkit.casting": (
        "OVERFLOW_MODES", "ROUNDING_MODES", "cast", "check_decodable", "check_floating",
        "round_to_grid", "saturate"),
    "fmtkit.formats": ("ALIASES", "Decomposition", "FORMATS", "Format", "decompose",
                       "get_format"),
    "fmtkit.telemetry": ("NumericsStats", "cast_stats", "compare", "quantize_stats",
                         "tree_stats"),
    "fmtkit.distributed": ("reduce_gradients",),
    "fmtkit.stats": (
        "BASE_STATS", "BLOCK_STATS", "QUANT_STATS", "RECONSTRUCTION_STATS", "TILE",
        "Quantization", "block_stats", "clip_threshold", "quant_stats", "reconstruction_stats",
        "tensor_stats"),
    "fmtkit.memory": ("MemoryLedger", "ledger"),
    "pallas_kernels": (
        "TuningConfig", "blockwise_fp8_dgrad", "blockwise_fp8_matmul",
        "blockwise_fp8_matmul_reference", "blockwise_fp8_wgrad", "config", "is_hopper", "num_sms",
        "quantize_128x128", "quantize_128x128_reference", "quantize_1x128",
        "quantize_1x128_reference"),
    "fmtkit.qwix": ("FmtkitProvider", "FmtkitRule", "from_qarray", "to_qarray"),
    # the deprecated former path of fmtkit.debug.log (warns once, on import)
    "fmtkit.debuglog": (
        "DECISIONS_NAME", "JSONL_NAME", "REDUCTIONS", "StatsLogger", "flatten_stats",
        "reduce_stat", "split_tag"),
    "fmtkit.debug.log": (
        "DECISIONS_NAME", "JSONL_NAME", "REDUCTIONS", "StatsLogger", "flatten_stats",
        "reduce_stat", "split_tag"),
}

DEPRECATED: dict[tuple[str, str], str] = {
    ("fmtkit.fp8", "FP8Recipe"): "fmtkit.fp8.Fp8Recipe",
    ("fmtkit.fp8", "Fp8DotState"): "fmtkit.DelayedScalingState",
    ("fmtkit.policy", "Fp8State"): "fmtkit.policy.DelayedScalingVariable",
}


NOT_IN_ALL: dict[str, tuple[str, ...]] = {
    "fmtkit.fp8": ("WIDENED_SCOPE", "DGRAD_SCOPE", "WGRAD_SCOPE", "on_blackwell"),
    "fmtkit.fp4": ("GEMM_SCOPE",),
}


def _problems(module: str, name: str) -> list[str]:
    """What is wrong with ``from module import name`` today (nothing: [])."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            getattr(importlib.import_module(module), name)  # `from module import name`
        except AttributeError as e:
            return [f"{module}.{name} does not import: {e}"]
    out = [f"{module}.{name} warns {w.category.__name__}: {w.message}" for w in caught
           if not issubclass(w.category, DeprecationWarning)]
    if (module, name) in DEPRECATED:
        if not any(DEPRECATED[module, name] in str(w.message) for w in caught):
            out.append(f"{module}.{name} is deprecated: it must warn naming "
                       f"{DEPRECATED[module, name]}")
    elif name not in importlib.import_module(module).__all__ and name not in NOT_IN_ALL.get(
            module, ()):
        out.append(f"{module}.{name} left __all__ without a deprecation")
    return out


@pytest.mark.parametrize("module", sorted(PUBLIC_NAMES))
def test_every_public_name_still_imports_from_the_same_place(module):
    if module == "fmtkit.qwix":  # needs the optional dependency (fmtkit[qwix])
        pytest.importorskip("qwix")
    problems = [p for name in PUBLIC_NAMES[module] for p in _problems(module, name)]
    assert not problems, "\n".join(problems)


def test_the_public_names_check_sees_a_removal(monkeypatch):
    # Negative controls: a missing name, a name dropped from __all__, a deprecated name that
    # stops warning.
    from fmtkit import fp8

    assert _problems("fmtkit.fp8", "Fp9Recipe")[0].startswith("fmtkit.fp8.Fp9Recipe does not")
    monkeypatch.setattr(fp8, "__all__", [n for n in fp8.__all__ if n != "scaled_matmul"])
    assert _problems("fmtkit.fp8", "scaled_matmul") == [
        "fmtkit.fp8.scaled_matmul left __all__ without a deprecation"]
    monkeypatch.setitem(vars(fp8), "FP8Recipe", fp8.Fp8Recipe)  # a plain alias: no warning
    assert "must warn" in _problems("fmtkit.fp8", "FP8Recipe")[0]
