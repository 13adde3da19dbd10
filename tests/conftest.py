"""Test configuration: strict numerics, so silent up-casts fail (STYLE.md rule 12)."""

import jax
import pytest

jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")


@pytest.fixture(autouse=True)
def _strict_numerics():
    """Re-asserts strict promotion in case a test or library context changed it."""
    with jax.numpy_dtype_promotion("strict"):
        yield
