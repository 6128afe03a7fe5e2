"""The engines' routes as they come: vLLM's numpy arrays and SGLang's base64 int32, checked
against the model (layers, top-k, expert ids, vLLM's dtype for the expert count)."""

from __future__ import annotations

import base64

import numpy as np
import pytest
import torch

from fsdp_precision.replay import MISSING, RouteShape, RoutingReplayError, from_sglang, from_vllm

SHAPE = RouteShape(layers=3, top_k=2, num_experts=8)
WIDE = RouteShape(layers=3, top_k=2, num_experts=300)


def _ids(rows: int, experts: int, dtype: type) -> np.ndarray:
    return (np.arange(rows * 3 * 2).reshape(rows, 3, 2) % experts).astype(dtype)


def _b64(array: np.ndarray) -> str:
    return base64.b64encode(array.astype("<i4").tobytes()).decode()


@pytest.mark.parametrize(("shape", "dtype"), [(SHAPE, np.uint8), (WIDE, np.uint16)])
def test_vllm_routes_read_as_int16_rows(shape: RouteShape, dtype: type) -> None:
    array = _ids(5, shape.num_experts, dtype)
    routes = from_vllm(array, shape)
    assert routes.dtype == torch.int16 and routes.shape == (5, 3, 2)
    assert torch.equal(routes, torch.from_numpy(array.astype(np.int16)))


def test_sglang_routes_read_with_padding_kept_missing() -> None:
    array = _ids(4, 8, np.int32).astype(np.int32)
    array[3] = -1  # a padded token
    routes = from_sglang(_b64(array), SHAPE)
    assert routes.shape == (4, 3, 2) and routes.dtype == torch.int16
    assert torch.equal(routes[:3], torch.from_numpy(array[:3].astype(np.int16)))
    assert bool((routes[3] == MISSING).all())


VLLM_REFUSED = {
    "start the engine with enable_return_routed_experts": (None, SHAPE),
    "are uint16, and vLLM gives uint8 for a model with 8 experts": (_ids(2, 8, np.uint16), SHAPE),
    "are uint8, and vLLM gives uint16 for a model with 300 experts": (_ids(2, 8, np.uint8), WIDE),
    r"shape \(2, 4, 2\); this model's are \[tokens - 1, 3, 2\]": (
        np.zeros((2, 4, 2), np.uint8),
        SHAPE,
    ),
    "expert ids from 0 to 9; this model has 8 experts": (_ids(2, 10, np.uint8), SHAPE),
}


@pytest.mark.parametrize("message", VLLM_REFUSED)
def test_vllm_routes_that_do_not_fit_are_refused_by_what_differs(message: str) -> None:
    array, shape = VLLM_REFUSED[message]
    with pytest.raises(RoutingReplayError, match=message):
        from_vllm(array, shape)


SGLANG_REFUSED = {
    "is not base64": "not base64!",
    "not a whole number of tokens of 3 layers x top-2": base64.b64encode(b"\0" * 28).decode(),
    "expert ids from -1 to 8; this model has 8 experts": _b64(
        np.array([-1, 0, 1, 2, 3, 8]).reshape(1, 3, 2)
    ),
    r"hold ids from -2 to 1, outside -1..7": _b64(np.array([-2, 0, 1, 1, 0, 0]).reshape(1, 3, 2)),
}


@pytest.mark.parametrize("message", SGLANG_REFUSED)
def test_sglang_routes_that_do_not_fit_are_refused_by_what_differs(message: str) -> None:
    with pytest.raises(RoutingReplayError, match=message):
        from_sglang(SGLANG_REFUSED[message], SHAPE)
