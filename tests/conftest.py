from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch.distributed as dist

import fsdp_precision as fp


@pytest.fixture(scope="session")
def world1() -> Iterator[None]:
    """A one-rank gloo process group in the test process itself (no spawn), patch applied."""
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        from _harness import _free_port

        os.environ["MASTER_PORT"] = str(_free_port())
        dist.init_process_group("gloo", rank=0, world_size=1)
    fp.apply_param_dtype_map_patch()
    yield
    dist.destroy_process_group()
