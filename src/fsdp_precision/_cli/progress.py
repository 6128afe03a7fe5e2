"""A dependency-free progress bar for rank 0: redrawn in place on a terminal, one line per step
otherwise (logs and CI keep every step)."""

from __future__ import annotations

import sys
import time
from typing import TextIO

__all__ = ["Progress"]


class Progress:
    """``[#####.....] 3/8 loss 4.8123 1.2 s/step`` on ``stream``."""

    def __init__(self, total: int, *, label: str, stream: TextIO | None = None, width: int = 24):
        self.total = total
        self.label = label
        self.stream = stream if stream is not None else sys.stdout
        self.width = width
        self.interactive = self.stream.isatty()
        self._start = time.perf_counter()
        self._done = 0

    def update(self, done: int, **values: float) -> None:
        """Show ``done`` of ``total`` steps and the given values (e.g. ``loss=...``)."""
        self._done = done
        filled = self.width * done // self.total
        bar = "#" * filled + "." * (self.width - filled)
        rate = (time.perf_counter() - self._start) / max(done, 1)
        shown = " ".join(f"{k} {v:.4f}" for k, v in values.items())
        line = f"{self.label} [{bar}] {done}/{self.total} {shown} {rate:.2f} s/step"
        if self.interactive:
            self.stream.write("\r" + line)
            if done == self.total:
                self.stream.write("\n")
        else:
            self.stream.write(line + "\n")
        self.stream.flush()
