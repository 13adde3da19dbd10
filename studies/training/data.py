"""The training bytes and the batch of each step (a pure function of seed and step)."""

from __future__ import annotations

import numpy as np

from studies.lib import corpus
from studies.training.config import TrainConfig

__all__ = ["batch_at", "heldout_tokens", "load_data"]


def load_data(cfg: TrainConfig) -> np.ndarray:
    """The training bytes as ``uint8[n]``: ``cfg.data`` (a UTF-8 file), the training part of
    the Python standard library (``cfg.data == "stdlib"``: ``studies.lib.corpus.stdlib_corpus``)
    or the embedded corpus.

    Raises:
      FileNotFoundError, IsADirectoryError, ValueError: a missing, folder, empty or non-UTF-8
        ``cfg.data`` (``studies.lib.corpus.load_text``); ValueError: fewer than seq_len bytes.
    """
    if cfg.data is None:
        raw = corpus.default_corpus(cfg.corpus_bytes)
    elif cfg.data == corpus.STDLIB:
        raw = corpus.stdlib_corpus().train
    else:
        raw = corpus.load_text(cfg.data)
    data = np.frombuffer(raw, dtype=np.uint8)
    if data.size < cfg.seq_len:
        where = "the corpus" if cfg.data is None else f"--data {cfg.data!r}"
        raise ValueError(f"{where} has {data.size} bytes, fewer than seq_len={cfg.seq_len}.")
    return data


def batch_at(data: np.ndarray, cfg: TrainConfig, step: int) -> np.ndarray:
    """The tokens of step ``step``: int32 ``[batch, seq_len]``, a pure function of
    ``(cfg.seed, step)`` (random start offsets from ``numpy.random.default_rng([seed, step])``).

    Example:
      >>> cfg = TrainConfig(batch=2, seq_len=4)
      >>> d = np.arange(100, dtype=np.uint8)
      >>> bool((batch_at(d, cfg, 7) == batch_at(d, cfg, 7)).all())
      True
    """
    rng = np.random.default_rng([cfg.seed, int(step)])
    starts = rng.integers(0, data.size - cfg.seq_len + 1, size=cfg.batch)
    return data[starts[:, None] + np.arange(cfg.seq_len)].astype(np.int32)


def heldout_tokens(cfg: TrainConfig) -> np.ndarray | None:
    """The held-out evaluation windows, int32 ``[cfg.heldout_windows, seq_len]``
    (``studies.lib.corpus.heldout_windows`` of the standard library's held-out files), or None
    when the data has no held-out part (anything but ``--data stdlib``) or
    ``heldout_windows`` is 0."""
    if cfg.data != corpus.STDLIB or cfg.heldout_windows == 0:
        return None
    return corpus.heldout_windows(corpus.stdlib_corpus().heldout, cfg.seq_len,
                                  cfg.heldout_windows)
