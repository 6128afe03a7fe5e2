"""The architecture screen at the thresholds the default tier leaves out (opt-in: ``-m slow``):
3% of each model's parameters and the config's default (the root only, for these tiny models).
Each case asserts what ``tests/train/test_screen.py`` says."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers", reason="the screen's architectures need transformers")
pytest.importorskip("diffusers", reason="the screen's architectures need diffusers")

from tests.support.harness import collect_cases, distributed_suite
from tests.train.test_screen import MORE_THRESHOLDS, screen_cases

pytestmark = pytest.mark.slow

screen_cases(globals(), MORE_THRESHOLDS)

CASES = collect_cases(globals())

results, test_screen = distributed_suite(2, __name__, CASES)
