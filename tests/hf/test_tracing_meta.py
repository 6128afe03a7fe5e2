"""The advisor's forward on the meta device reaches its end where transformers would read a
tensor's values to take a shortcut (``Tensor.item() cannot be called on meta tensors``): under
:func:`traceable_meta` a meta tensor is taken for what it is, a tensor without values, as
torch.compile's fake tensors are, and the shortcut is skipped."""

from __future__ import annotations

import contextlib

import pytest

pytest.importorskip("transformers", reason="transformers is not installed")

from fsdp_precision import advise  # noqa: E402
from fsdp_precision._advise import usage  # noqa: E402
from fsdp_precision._cli.spec import resolve  # noqa: E402
from fsdp_precision._hf.tracing import traceable_meta  # noqa: E402

#: A padding-mask shortcut (BART), a packed-sequence check (PaliGemma), both on the meta device.
TYPES = ["bart", "paligemma"]


@pytest.mark.parametrize("model_type", TYPES)
def test_the_meta_trace_reaches_the_end(model_type: str) -> None:
    advice = advise(resolve(f"hf:{model_type}").build())
    assert advice.covered and "stopped early" not in advice.traced, advice.traced


@pytest.mark.parametrize("model_type", TYPES)
def test_without_it_the_trace_stops_at_a_value(
    model_type: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(usage, "traceable_meta", contextlib.nullcontext)
    advice = advise(resolve(f"hf:{model_type}").build())
    assert "Tensor.item() cannot be called on meta tensors" in advice.traced


def test_it_is_restored_and_leaves_real_tensors_alone() -> None:
    import torch
    from transformers.utils import import_utils

    original = import_utils.is_fake_tensor
    with traceable_meta():
        assert import_utils.is_tracing(torch.empty(2, device="meta"))
        assert not import_utils.is_tracing(torch.empty(2))
    assert import_utils.is_fake_tensor is original
    assert not import_utils.is_tracing(torch.empty(2, device="meta"))
