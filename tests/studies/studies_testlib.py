"""Helpers shared by the study tests: plots that hold a drawing, CLI messages as text, a
progress bar that interrupts a run (resume tests)."""

import re
from pathlib import Path

import numpy as np


def assert_plots(paths):
    """Each path is a PNG that decodes to an image with a drawing on it (not blank)."""
    import matplotlib.image

    assert paths
    for p in paths:
        img = matplotlib.image.imread(Path(p), format="png")  # raises on a broken file
        assert img.ndim == 3 and min(img.shape[:2]) >= 100, (p, img.shape)
        colors = np.unique(img.reshape(-1, img.shape[-1]), axis=0)
        # Lines, labels and antialiasing give hundreds of colours; a blank canvas one.
        assert len(colors) >= 16, f"{p}: {len(colors)} colours, a blank figure"


def plain(text):
    """Command-line output without the boxes tyro draws around messages, whitespace
    collapsed (tyro wraps long messages to the terminal width)."""
    return " ".join(re.sub(r"[│╭╮╰╯─]", " ", text).split())


class Interrupted(Exception):
    """Raised by ``stop_after``'s progress bar in place of a killed run."""


def stop_after(k):
    """A progress factory whose iterator raises ``Interrupted`` before item ``k``."""
    def progress(iterable, *, total=None, desc=None):
        for n, item in enumerate(iterable):
            if n == k:
                raise Interrupted
            yield item

    return progress
