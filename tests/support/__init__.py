"""What the tests share: the distributed harness, test models, real architectures at tiny sizes."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

#: The repository root (the ``PYTHONPATH`` of subprocesses that import ``tests.support``).
ROOT = Path(__file__).resolve().parents[2]

#: ``export_safetensors`` writes with safetensors and huggingface_hub (the ``hf`` extra); the
#: wheel's CI venv installs only ``[test]``, where the tests that export skip, saying so.
requires_export = pytest.mark.skipif(
    any(importlib.util.find_spec(p) is None for p in ("safetensors", "huggingface_hub")),
    reason="export_safetensors needs safetensors and huggingface_hub: pip install '.[hf]'",
)


def load_script(relative: str) -> ModuleType:
    """Import a repository script (``"scripts/screen_hf_keep.py"``) as a module named after its
    file, its folder put on ``sys.path``: spawned ranks (which import their function by module
    name, with this process's ``sys.path``) find it too."""
    path = ROOT / relative
    folder = str(path.parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    return importlib.import_module(path.stem)
