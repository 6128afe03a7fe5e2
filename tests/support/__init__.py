"""What the tests share: the distributed harness, test models, real architectures at tiny sizes."""

from __future__ import annotations

from pathlib import Path

#: The repository root (the ``PYTHONPATH`` of subprocesses that import ``tests.support``).
ROOT = Path(__file__).resolve().parents[2]
