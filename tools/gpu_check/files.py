"""The check's files: JSON written atomically, per-phase results, the log tarball."""

from __future__ import annotations

import json
import os
import tarfile
from pathlib import Path
from typing import Any

__all__ = ["REPO", "read_json", "record", "tar_logs", "write_json"]

REPO = Path(__file__).resolve().parents[2]
"""The checkout the check runs in (workers, the training step and pytest run from it)."""


def write_json(path: Path, data: Any) -> None:
    """Writes ``data`` to ``path`` through a temporary file, so a reader never sees half."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str))
    os.replace(tmp, path)


def read_json(path: Path, default: Any = None) -> Any:
    """``path``'s JSON, or ``default`` where it is missing or unreadable."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return default


def record(results_file: Path, name: str, result: dict) -> None:
    """Adds one item's result to a phase's results file."""
    data = read_json(results_file, {"items": {}})
    data["items"][name] = result
    write_json(results_file, data)


def tar_logs(work: Path, out_file: Path) -> None:
    """Every file of the work folder, under ``gpu_check_logs/``, into ``out_file``."""
    tmp = out_file.with_name(out_file.name + ".tmp")
    with tarfile.open(tmp, "w:gz") as tar:
        for f in sorted(work.rglob("*")):
            if f.is_file() and not f.name.endswith(".tmp"):
                tar.add(f, arcname=str(Path("gpu_check_logs") / f.relative_to(work)))
    os.replace(tmp, out_file)
