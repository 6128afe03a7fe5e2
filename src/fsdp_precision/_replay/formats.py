"""The engines' routes, read and checked against the model.

Both engines give one sequence's routes as ``[tokens - 1, layers, top_k]`` expert ids, rows by
absolute decoder-layer index (dense layers' rows zero): the last token is never run through the
model, so it has no row (:func:`~fsdp_precision._replay.layout.batch_routes` adds it).

* vLLM: ``CompletionOutput.routed_experts``, a numpy array, uint8 where the model has at most
  256 experts and uint16 otherwise (``enable_return_routed_experts``).
* SGLang: ``meta_info["routed_experts"]``, base64 of flat int32 (``return_routed_experts``);
  a padded token's ids are -1 (on CUDA).

Read ids are int16 (``-1``: no route, filled by the layout); every read checks the layer count,
the top-k and the id range, on the host, before anything reaches the trainer.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

import numpy as np
import torch

from fsdp_precision._base.errors import RoutingReplayError
from fsdp_precision._replay.routers import RouteShape

__all__ = ["MISSING", "from_sglang", "from_vllm"]

#: The id of a row with no route (a padded token, the last token): the layout fills it.
MISSING = -1


def from_vllm(routed_experts: Any, shape: RouteShape) -> torch.Tensor:
    """One sequence's routes from vLLM's ``CompletionOutput.routed_experts``, as int16
    ``[tokens - 1, layers, top_k]``, checked against ``shape``."""
    if routed_experts is None:
        raise RoutingReplayError(
            "vLLM returned no routed_experts: start the engine with "
            "enable_return_routed_experts=True (docs/routing-replay.md)"
        )
    array = np.asarray(routed_experts)
    wide = shape.num_experts > 256
    expected = np.uint16 if wide else np.uint8
    if array.dtype != expected:
        raise RoutingReplayError(
            f"vLLM's routed_experts are {array.dtype}, and vLLM gives {np.dtype(expected).name} "
            f"for a model with {shape.num_experts} experts: these routes are from another "
            "model, or were converted on the way"
        )
    return _checked(array.astype(np.int16), shape, "vLLM", allow_missing=False)


def from_sglang(routed_experts: str | bytes, shape: RouteShape) -> torch.Tensor:
    """One sequence's routes from SGLang's ``meta_info["routed_experts"]`` (base64 of int32),
    as int16 ``[tokens - 1, layers, top_k]``, checked against ``shape``; padded tokens' -1
    stay -1 (:data:`MISSING`)."""
    try:
        raw = base64.b64decode(routed_experts, validate=True)
    except (binascii.Error, ValueError, TypeError) as error:
        raise RoutingReplayError(
            f"SGLang's routed_experts is not base64 ({error}): pass "
            "meta_info['routed_experts'] as the engine returned it"
        ) from None
    per_token = shape.layers * shape.top_k
    if len(raw) % (4 * per_token):
        raise RoutingReplayError(
            f"SGLang's routed_experts hold {len(raw)} bytes, not a whole number of tokens of "
            f"{shape.layers} layers x top-{shape.top_k} int32 ids: these routes are from "
            "another model"
        )
    flat = np.frombuffer(raw, dtype="<i4").reshape(-1, shape.layers, shape.top_k)
    if flat.size and (flat.max() >= 2**15 or flat.min() < MISSING):
        raise RoutingReplayError(
            f"SGLang's routed_experts hold ids from {flat.min()} to {flat.max()}, outside "
            f"{MISSING}..{shape.num_experts - 1}"
        )
    return _checked(flat.astype(np.int16), shape, "SGLang", allow_missing=True)


def _checked(
    array: np.ndarray[Any, Any], shape: RouteShape, engine: str, *, allow_missing: bool
) -> torch.Tensor:
    if array.ndim != 3 or array.shape[1:] != (shape.layers, shape.top_k):
        raise RoutingReplayError(
            f"{engine}'s routes have shape {array.shape}; this model's are [tokens - 1, "
            f"{shape.layers}, {shape.top_k}] ({shape.layers} decoder layers, top-{shape.top_k})"
        )
    low = MISSING if allow_missing else 0
    if array.size and (array.min() < low or array.max() >= shape.num_experts):
        raise RoutingReplayError(
            f"{engine}'s routes hold expert ids from {array.min()} to {array.max()}; this "
            f"model has {shape.num_experts} experts (0..{shape.num_experts - 1})"
        )
    return torch.from_numpy(np.ascontiguousarray(array))
