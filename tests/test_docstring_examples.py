"""The ``Example:`` sections of the FP8, FP4, scaling and optax modules run and print what they
say (doctest), under the test suite's strict dtype promotion."""

import doctest
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fmtkit import optim

# A package's examples sit in the module that defines each function (doctest reads a
# module's own functions): fmtkit.fp8's in its private modules.
MODULES = ["fmtkit.fp8._dot", "fmtkit.fp8._fp4_quant", "fmtkit.fp4", "fmtkit.scaling",
           "fmtkit.optim._adam", "fmtkit.optim._loss_scale", "fmtkit.optim._common",
           "fmtkit.optim._accumulate", "fmtkit.optim._master"]
# optax.apply_updates (used by _master's examples) is not strict-promotion clean.
STANDARD_PROMOTION = {"fmtkit.optim._master"}


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
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
