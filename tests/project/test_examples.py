"""Every example in examples/ runs as documented."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = sorted((Path(__file__).parents[2] / "examples").glob("*.py"))


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_runs(path: Path) -> None:
    pytest.importorskip("transformers")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_PORT": "0"}
    from fsdp_precision._base.dist import free_port as _free_port

    env["MASTER_PORT"] = str(_free_port())
    out = subprocess.run(
        [sys.executable, str(path)], capture_output=True, text=True, timeout=300, env=env
    )
    assert out.returncode == 0, out.stderr[-3000:]
    expected = {
        "plan_and_wrap.py": "router gathered in torch.float32",
        "train_distributed.py": "step 3: loss",
    }
    assert expected[path.name] in out.stdout, out.stdout[-2000:]
