"""The release a user installs: ``python -m build`` makes a wheel that installs into a fresh
virtual environment and runs ``fmtkit formats`` and a policy example there.

Offline by construction: the wheel is built without build isolation (with the pinned
setuptools of the test extra), installed with ``--no-deps --no-index``, and the fresh
environment reads its dependencies (jax, flax, ...) from this environment's site-packages
through a ``.pth`` line, after its own: the ``fmtkit`` it imports is the wheel's.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SKIP = shutil.ignore_patterns(".git", ".venv", "runs", "site", "build", "dist", "*.egg-info",
                              "__pycache__", ".pytest_cache", ".hypothesis")

POLICY_EXAMPLE = """
import jax, jax.numpy as jnp, flax.linen as nn
import fmtkit
from fmtkit import inspect_policy, with_policy

model = with_policy(nn.Dense(4), "bf16-mixed")
x = jnp.ones((2, 3))
variables = model.init(jax.random.key(0), x)
assert model.apply(variables, x).dtype == jnp.float32
assert inspect_policy(model, x).policied_fraction() == 1.0
print(fmtkit.__file__)
"""


def _run(args, cwd, **kw):
    done = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=600, **kw)
    assert done.returncode == 0, f"{args} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


@pytest.mark.slow  # a wheel build and a fresh venv: about a minute
def test_the_wheel_installs_into_a_fresh_venv_and_runs(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=SKIP)
    _run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir",
          str(tmp_path / "dist"), str(src)], cwd=tmp_path)
    (wheel,) = (tmp_path / "dist").glob("fmtkit-0.1.0-py3-none-any.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "fmtkit/__init__.py" in names and "pallas_kernels/__init__.py" in names
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    assert not any(n.startswith(("tests/", "examples/", "docs/")) for n in names)

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], cwd=tmp_path)
    python, fmtkit_cli = venv / "bin" / "python", venv / "bin" / "fmtkit"
    site = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_path("
                                          "'purelib'))"], cwd=tmp_path).strip())
    (site / "zz_test_deps.pth").write_text(sysconfig.get_path("purelib") + "\n")
    _run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
         cwd=tmp_path)

    table = _run([str(fmtkit_cli), "formats"], cwd=tmp_path)
    assert "float8_e4m3fn" in table and "448" in table
    where = _run([str(python), "-c", POLICY_EXAMPLE], cwd=tmp_path).strip().splitlines()[-1]
    assert Path(where).is_relative_to(site), f"imported {where}, not the wheel's fmtkit"
