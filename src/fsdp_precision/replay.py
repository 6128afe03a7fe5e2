"""Routing replay: the trainer's MoE routers pick the experts the inference engine picked.

An RL step samples with an engine and trains on the samples; where the engine's kernels move a
near-tie, the trainer's forward routes a token to other experts than the rollout did, and the
logprobs the loss compares come from two different networks (R3, arXiv 2510.11370). Replay
takes the engine's expert ids per token and layer and makes each router use them, with the
combine weights still computed by the live router (in the gate's kept dtype), so the gate keeps
its gradient:

>>> from fsdp_precision import replay                                    # doctest: +SKIP
>>> rr = replay.RoutingReplay(model)      # finds the routers; refuses others by name
>>> seqs = [replay.from_vllm(o.outputs[0].routed_experts, rr.shape) for o in outputs]
>>> routes = replay.batch_routes(seqs, rr.shape, attention_mask=batch["attention_mask"])
>>> with rr.routes(routes):
...     loss = loss_fn(model(**batch)); loss.backward()

Routes stay set until replaced, so the recompute of activation checkpointing replays them too.
``docs/routing-replay.md`` lists the families replay drives and those it refuses, and how RL
frameworks pass routes in.
"""

from __future__ import annotations

from fsdp_precision._base.errors import RoutingReplayError
from fsdp_precision._replay.formats import MISSING, from_sglang, from_vllm
from fsdp_precision._replay.layout import batch_routes, spread
from fsdp_precision._replay.replay import RoutingReplay
from fsdp_precision._replay.routers import RouteShape

__all__ = [
    "MISSING",
    "RouteShape",
    "RoutingReplay",
    "RoutingReplayError",
    "batch_routes",
    "from_sglang",
    "from_vllm",
    "spread",
]
