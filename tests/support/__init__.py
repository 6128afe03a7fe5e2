"""What the tests share: the distributed harness, test models, real architectures at tiny sizes."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

#: The repository root (the ``PYTHONPATH`` of subprocesses that import ``tests.support``).
ROOT = Path(__file__).resolve().parents[2]


def load_script(relative: str) -> ModuleType:
    """Import a repository script (``"scripts/screen_hf_keep.py"``) as a module named after its
    file, its folder put on ``sys.path``: spawned ranks (which import their function by module
    name, with this process's ``sys.path``) find it too."""
    path = ROOT / relative
    folder = str(path.parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    return importlib.import_module(path.stem)
