"""``load_model_state_dict`` hands the state dict's ``_metadata`` (each module's version) to the
modules' ``_load_from_state_dict``, which migrates older layouts by it (the verl seed): in one
process, full and sharded, plain and wrapped."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import pytest
import torch
import torch.nn as nn
from torch.distributed.fsdp import fully_shard

from fsdp_precision.checkpoint import load_model_state_dict, model_state_dict

pytestmark = pytest.mark.usefixtures("world1")


class Versioned(nn.Module):
    """Version 2 stores ``w``; a version-1 state dict held ``2 * w`` (a migrated convention)."""

    _version = 2

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(4))

    def _load_from_state_dict(self, state_dict: Any, prefix: str, local_metadata: Any,
                              *args: Any) -> None:  # fmt: skip
        if local_metadata.get("version", self._version) < 2 and prefix + "w" in state_dict:
            state_dict[prefix + "w"] = state_dict[prefix + "w"] / 2
        super()._load_from_state_dict(state_dict, prefix, local_metadata, *args)


def old_state_dict(kind: str, model: nn.Module) -> dict[str, Any]:
    sd = model_state_dict(model, kind)  # type: ignore[arg-type]
    out: Any = OrderedDict((k, v * 2 if k == "0.w" else v) for k, v in sd.items())
    out._metadata = OrderedDict(
        [("", {"version": 1}), ("0", {"version": 1}), ("1", {"version": 1})]
    )
    return out  # type: ignore[no-any-return]


@pytest.mark.parametrize(("kind", "wrapped"), [("full", False), ("full", True), ("sharded", True)])
def test_module_versions_reach_load_from_state_dict(kind: str, wrapped: bool) -> None:
    torch.manual_seed(0)
    source = nn.Sequential(Versioned(), nn.Linear(4, 4))
    with torch.no_grad():
        source[0].w.copy_(torch.arange(4.0))
    target = nn.Sequential(Versioned(), nn.Linear(4, 4))
    if wrapped:
        fully_shard(source)
        fully_shard(target)
    old = old_state_dict(kind, source)
    load_model_state_dict(target, old, kind)  # type: ignore[arg-type]
    w = target[0].w
    w = w.full_tensor() if hasattr(w, "full_tensor") else w
    assert torch.equal(w.detach(), torch.arange(4.0))  # migrated: halved back
    # Negative control: the same tensors without the versions load as they are.
    plain = OrderedDict(old)
    load_model_state_dict(target, plain, kind)  # type: ignore[arg-type]
    w = target[0].w
    w = w.full_tensor() if hasattr(w, "full_tensor") else w
    assert torch.equal(w.detach(), 2 * torch.arange(4.0))
