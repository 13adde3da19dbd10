"""Every script in examples/ runs as a user runs it: its own process, from the repository
root, exit status 0, in well under a minute of CPU time each on a 2-core machine."""

import subprocess
import sys
from pathlib import Path

import pytest
from child_env import child_env

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))


def test_there_are_examples_and_the_docs_show_each():
    assert len(EXAMPLES) >= 5
    page = (ROOT / "docs" / "examples.md").read_text()
    for path in EXAMPLES:
        assert f'--8<-- "examples/{path.name}"' in page, f"docs/examples.md lacks {path.name}"


@pytest.mark.slow  # each trains a small model: 10-60 s
@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_runs(path):
    env = child_env()  # as a user starts it (but compiled faster: tests/child_env.py)
    done = subprocess.run([sys.executable, str(path)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, f"{path.name} failed:\n{done.stdout}\n{done.stderr}"
    assert done.stdout.strip(), f"{path.name} printed nothing"
