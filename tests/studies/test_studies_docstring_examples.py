"""The ``Example:`` sections of the studies' modules run and print what they say (doctest).

Found, not listed: every module under ``studies`` whose source holds a ``>>>`` line.
"""

import doctest
import importlib
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
MODULES = [".".join(p.relative_to(ROOT).with_suffix("").parts)
           for p in sorted((ROOT / "studies").rglob("*.py")) if ">>>" in p.read_text()]


def test_the_examples_are_found():
    assert "studies.lib.stats" in MODULES


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
    mod = importlib.import_module(name)
    globs = {**vars(mod), "jnp": jnp, "np": np, "jax": jax}
    with jax.numpy_dtype_promotion("standard"):  # study code runs as a user's script does
        result = doctest.testmod(mod, extraglobs=globs, optionflags=doctest.ELLIPSIS,
                                 verbose=False, report=False)
    if result.attempted == 0:  # every example says +SKIP (it writes files or trains)
        assert "doctest: +SKIP" in Path(mod.__file__).read_text()
    assert result.failed == 0, f"{result.failed} failing example(s) in {name}"
