"""Replay routes inside each router's own forward.

Every router transformers' MoE families build computes its scores, calls ``topk`` over its
experts once, and derives its combine weights from what that call returns (normalised, scaled,
softmaxed as the family does). Replay runs the router's own forward with that one call answered
from the routes: the indices are the engine's, the values are the call's input gathered at them.
So the expert ids are the engine's, the weights come from the live router's dense scores in the
gate's own dtype (an id the live router would not pick still gets its probability and its
gradient), and each family normalises as it always does. Routes are held per router (keyed by
its decoder layer) until replaced, so the recompute of activation checkpointing replays the
same routes as the forward.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode

from fsdp_precision._base.errors import RoutingReplayError
from fsdp_precision._replay.routers import FoundRouter, RouteShape, find_routers

__all__ = ["RoutingReplay"]

logger = logging.getLogger(__name__)

_TOPK = (torch.topk, torch.Tensor.topk)


class _Select(TorchFunctionMode):
    """Answers the router's one ``topk`` over its experts with the replayed ids."""

    def __init__(self, ids: torch.Tensor, shape: RouteShape) -> None:
        super().__init__()
        self.ids = ids
        self.shape = shape
        self.hits = 0

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func in _TOPK:
            scores, k, dim = _topk_arguments(args, kwargs)
            width = scores.shape[dim] if scores.dim() else 0
            if k == self.shape.top_k and width == self.shape.num_experts:
                self.hits += 1
                ids = self.ids.reshape(*scores.shape[:dim], -1, *scores.shape[dim:][1:])
                return torch.return_types.topk((scores.gather(dim, ids), ids))
        return func(*args, **kwargs)


def _topk_arguments(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[torch.Tensor, int, int]:
    scores = args[0] if args else kwargs["input"]
    k = args[1] if len(args) > 1 else kwargs["k"]
    dim = args[2] if len(args) > 2 else kwargs.get("dim", -1)
    return scores, int(k), dim % max(scores.dim(), 1)


class RoutingReplay:
    """Replay an inference engine's routes in ``model``'s routers.

    Finds the routers (:func:`~fsdp_precision._replay.routers.find_routers`; a family replay
    cannot drive is refused by name, before anything is changed) and wraps each one's
    ``forward``. Set the routes of a batch (``[batch, seq, layers, top_k]`` or ``[tokens,
    layers, top_k]``, aligned with the tokens by :func:`~fsdp_precision.replay.batch_routes`)
    before its forward; they stay set until replaced or cleared, so backward's recompute under
    activation checkpointing replays them too. A router that runs with no routes set raises,
    unless inside :meth:`live`.

    >>> replay = RoutingReplay(model)  # doctest: +SKIP
    >>> with replay.routes(batch_routes(seqs, replay.shape, attention_mask=mask)):
    ...     model(input_ids=ids, attention_mask=mask).loss.backward()
    """

    def __init__(self, model: nn.Module) -> None:
        routers, shape = find_routers(model)
        #: The routers replay drives, in model order.
        self.routers: tuple[FoundRouter, ...] = routers
        #: One token's routes: decoder layers, top-k, experts.
        self.shape: RouteShape = shape
        self._routes: torch.Tensor | None = None
        self._live = False
        #: Per wrapped router (by id): the instance's own ``forward`` before ours, if it had one.
        self._before: dict[int, Any] = {}
        for router in routers:
            self._wrap(router)
        logger.info(
            "routing replay drives %d routers (%s) over %d decoder layers",
            len(routers),
            routers[0].cls,
            shape.layers,
        )

    def set(self, routes: torch.Tensor) -> None:
        """Replay ``routes`` in every forward (and recompute) until replaced or cleared.

        ``routes``: integer ids, ``[batch, seq, layers, top_k]`` or ``[tokens, layers, top_k]``,
        tokens in the order the batch flattens them. Moved to the routers' device once here.
        """
        if routes.is_floating_point() or routes.is_complex() or routes.dtype == torch.bool:
            raise RoutingReplayError(
                f"routes must hold integer expert ids, got {routes.dtype}; read the engine's "
                "with from_vllm/from_sglang and align them with batch_routes"
            )
        layers, top_k = self.shape.layers, self.shape.top_k
        if routes.dim() not in (3, 4) or tuple(routes.shape[-2:]) != (layers, top_k):
            raise RoutingReplayError(
                f"routes of shape {tuple(routes.shape)} do not fit this model: expected "
                f"[batch, seq, {layers}, {top_k}] or [tokens, {layers}, {top_k}] ({layers} "
                f"decoder layers, top-{top_k})"
            )
        device = next(self.routers[0].module.parameters(), routes).device
        self._routes = routes.reshape(-1, layers, top_k).to(device, non_blocking=True)

    def clear(self) -> None:
        """Drop the routes; a router that runs next raises until new routes are set."""
        self._routes = None

    @contextmanager
    def routes(self, routes: torch.Tensor) -> Iterator[None]:
        """:meth:`set` ``routes`` for the block (forward and backward), then :meth:`clear`."""
        self.set(routes)
        try:
            yield
        finally:
            self.clear()

    @contextmanager
    def live(self) -> Iterator[None]:
        """Route live (the model's own selection) inside the block: evaluation, generation."""
        previous, self._live = self._live, True
        try:
            yield
        finally:
            self._live = previous

    def remove(self) -> None:
        """Give every router its own ``forward`` back."""
        for router in self.routers:
            if id(router.module) not in self._before:
                continue  # removed already
            before = self._before.pop(id(router.module))
            if before is None:
                del router.module.forward  # the class's forward again
            else:
                router.module.forward = before  # another wrapper's, set before ours
        self._routes = None

    def explain(self) -> str:
        """Which routers replay drives, by decoder layer, and the memory routes take."""
        shape = self.shape
        lines = [
            f"routing replay: {len(self.routers)} routers, {shape.layers} decoder layers, "
            f"top-{shape.top_k} of {shape.num_experts} experts; routes hold "
            f"{shape.bytes_per_token()} bytes per token on the device while set"
        ]
        lines += [f"  layer {r.layer:>3}: {r.fqn} ({r.cls})" for r in self.routers]
        return "\n".join(lines)

    def _ids(self, router: FoundRouter, hidden: torch.Tensor) -> torch.Tensor | None:
        if self._live:
            return None
        if self._routes is None:
            raise RoutingReplayError(
                f"router {router.fqn!r} ran with routing replay attached and no routes set: "
                "set the batch's routes (replay.set or `with replay.routes(...)`, with the "
                "backward inside it under activation checkpointing), or route live inside "
                "`with replay.live():`"
            )
        tokens = hidden.numel() // hidden.shape[-1]
        if tokens != self._routes.shape[0]:
            raise RoutingReplayError(
                f"router {router.fqn!r} saw {tokens} tokens and the routes set hold "
                f"{self._routes.shape[0]}: align the routes with this batch (batch_routes)"
            )
        return self._routes[:, router.layer].long()

    def _wrap(self, router: FoundRouter) -> None:
        module = router.module
        original = module.forward
        self._before[id(module)] = vars(module).get("forward")

        def forward(*args: Any, **kwargs: Any) -> Any:
            hidden = args[0] if args else next(iter(kwargs.values()))
            ids = self._ids(router, hidden)
            if ids is None:
                return original(*args, **kwargs)
            select = _Select(ids, self.shape)
            with select:
                out = original(*args, **kwargs)
            if select.hits != 1:
                raise RoutingReplayError(
                    f"router {router.fqn!r} ({router.cls}) called topk over its "
                    f"{self.shape.num_experts} experts {select.hits} times; replay drives "
                    "routers that select once (docs/routing-replay.md)"
                )
            return out

        module.forward = forward
