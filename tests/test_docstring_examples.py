"""The ``Example:`` sections of every module that has them run and print what they say
(doctest), under the test suite's strict dtype promotion.

The modules are found, not listed: every module of ``fmtkit`` and ``pallas_kernels`` whose
source holds a ``>>>`` line (the studies' own are run by tests/studies). A module moved or
split keeps its examples tested.
"""

import doctest
import importlib
import inspect
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fmtkit import optim

ROOT = Path(__file__).resolve().parents[1]


def modules_with_examples(*packages: str) -> list[str]:
    """Dotted names of the modules under ``packages`` whose source has a ``>>>`` line."""
    names = []
    for package in packages:
        for path in sorted((ROOT / package).rglob("*.py")):
            if ">>>" in path.read_text():
                parts = path.relative_to(ROOT).with_suffix("").parts
                names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


MODULES = modules_with_examples("fmtkit", "pallas_kernels")
# optax.apply_updates (used by _master's examples) and Flax's layers (the policy examples
# build linen and NNX models) are not strict-promotion clean.
STANDARD_PROMOTION = {"fmtkit.optim._master"} | {m for m in MODULES
                                                 if m.startswith("fmtkit.policy")}


def test_the_examples_are_found():
    assert {"fmtkit.scaling", "fmtkit.formats", "fmtkit.optim._adam"} <= set(MODULES)
    assert len(MODULES) >= 15


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
    if name == "fmtkit.qwix":  # needs the optional dependency (fmtkit[qwix])
        pytest.importorskip("qwix")
    mod = importlib.import_module(name)
    globs = {**vars(mod), "jnp": jnp, "np": np, "jax": jax, "optax": optax}
    promotion = "standard" if name in STANDARD_PROMOTION else "strict"
    with jax.numpy_dtype_promotion(promotion):
        result = doctest.testmod(mod, extraglobs=globs, optionflags=doctest.ELLIPSIS,
                                 verbose=False, report=False)
    assert result.attempted > 0
    assert result.failed == 0, f"{result.failed} failing example(s) in {name}"


def test_clipping_inside_the_scaler_sees_unscaled_gradients():
    """The loss_scale example's composition: clip inside dynamic_loss_scale clips the true
    gradient (norm 5 -> 1); chained before it, the clip sees 2^16 * g and the step shrinks
    by 2^16 (the composition PyTorch's AMP notes warn against)."""
    g = jnp.array([3.0, 4.0], jnp.float32)  # norm 5
    scale = 2.0**16
    right = optim.dynamic_loss_scale(optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(1.0)))
    wrong = optax.chain(optax.clip_by_global_norm(1.0), optim.dynamic_loss_scale(optax.sgd(1.0)))
    p = jnp.zeros(2)
    u_right, _ = right.update(g * scale, right.init(p), p)
    u_wrong, _ = wrong.update(g * scale, wrong.init(p), p)
    np.testing.assert_allclose(np.asarray(u_right), [-0.6, -0.8], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(u_wrong) * scale, [-0.6, -0.8], rtol=1e-6)


# --- How many public functions and classes show an example ---------------------------------

# The names people call first: each shows how in its docstring.
MUST_HAVE_EXAMPLES = [
    "fmtkit.policy.with_policy", "fmtkit.policy.inspect_policy", "fmtkit.debug.init",
    "fmtkit.debug.capture", "fmtkit.fp8.update_state", "fmtkit.fp8.dot_general_fn",
    "fmtkit.telemetry.quantize_stats", "fmtkit.scaling.quantize", "fmtkit.casting.cast",
    "fmtkit.optim.dynamic_loss_scale", "fmtkit.optim.master_weights",
    "fmtkit.optim.stochastic_round_updates", "fmtkit.optim.kahan_updates",
    "fmtkit.optim.adamw", "fmtkit.optim.multi_steps",
]
# Share of the public functions and classes (each object once, wherever re-exported) whose
# docstring has a doctest; raise it as examples are added, never lower it.
EXAMPLE_SHARE = 0.80


def public_callables() -> dict[str, object]:
    """``module.NAME`` -> object for every public function and class, each object once."""
    from test_api_reference import PUBLIC_MODULES

    seen: dict[int, str] = {}
    out = {}
    for mod in PUBLIC_MODULES:
        module = importlib.import_module(mod)
        for name in module.__all__:
            obj = getattr(module, name)
            if (inspect.isclass(obj) or inspect.isfunction(obj)) and id(obj) not in seen:
                seen[id(obj)] = f"{mod}.{name}"
                out[f"{mod}.{name}"] = obj
    return out


def has_example(obj: object) -> bool:
    return ">>>" in (inspect.getdoc(obj) or "")


def test_the_public_names_people_call_first_have_examples():
    def resolve(dotted):
        mod, name = dotted.rsplit(".", 1)
        return getattr(importlib.import_module(mod), name)

    missing = [n for n in MUST_HAVE_EXAMPLES if not has_example(resolve(n))]
    assert not missing, f"no Example: section in the docstring of {missing}"


def test_most_public_functions_and_classes_have_examples():
    names = public_callables()
    with_example = [n for n, obj in names.items() if has_example(obj)]
    share = len(with_example) / len(names)
    assert share >= EXAMPLE_SHARE, (
        f"{len(with_example)} of {len(names)} public functions and classes have an example "
        f"({share:.0%}); without one: {sorted(set(names) - set(with_example))}")
    assert not has_example(lambda: None) and has_example(names["fmtkit.qdq"])
