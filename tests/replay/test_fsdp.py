"""Replay under FSDP2 on two ranks, bf16 compute with the routers kept in fp32: in one unit with
the block and as units of their own (the separate-units layout), with activation checkpointing,
and compiled. Each rank replays its own batch's routes: replaying the live routes is the live
forward bitwise, other routes reach the experts exactly (in the forward and in backward's
recompute), the gate computes in fp32 and gets a finite, non-zero gradient."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers", reason="transformers is not installed")

import fsdp_precision as fp  # noqa: E402
from fsdp_precision.replay import RoutingReplay  # noqa: E402

from tests.replay import support  # noqa: E402
from tests.support.harness import distributed_suite  # noqa: E402

RULES = fp.PrecisionRules(
    param_dtype=torch.bfloat16, reduce_dtype=torch.float32, rules=(fp.Glob("*.mlp.gate.weight"),)
)


def _run(layout: str, *, checkpoint: bool = False, compile_units: str = "off") -> None:
    net = support.model()
    if checkpoint:
        net.activation_checkpointing_enable({"use_reentrant": False})
    config = fp.DistributedConfig(
        fsdp_mixed_precision=RULES,
        fsdp_layout=layout,  # type: ignore[arg-type]
        fsdp_auto_wrap_policy="transformer_block",
        compile_units=compile_units,  # type: ignore[arg-type]
    )
    net = fp.wrap_model_for_training(net, config)
    ids = support.batch(seed=10 + dist.get_rank())
    with torch.no_grad():
        live = net(ids).logits
    routes = support.live_routes(net, ids)
    replay = RoutingReplay(net)
    with replay.routes(routes), torch.no_grad():
        assert torch.equal(net(ids).logits, live), "replaying the live routes changed the forward"

    shifted = support.other_routes(routes)
    received: dict[int, list[torch.Tensor]] = {}
    gate_dtypes: set[torch.dtype] = set()
    for i, layer in enumerate(net.model.layers):
        if i:
            layer.mlp.experts.register_forward_hook(
                lambda m, a, out, i=i: received.setdefault(i, []).append(a[1])
            )
            layer.mlp.gate.register_forward_pre_hook(lambda m, a: gate_dtypes.add(m.weight.dtype))
    with replay.routes(shifted):
        picked = support.picked(net, lambda: net(ids, labels=ids).loss.backward())
    for layer, calls in picked.items():
        # under checkpointing, backward's recompute runs the router again (not its experts:
        # torch's recompute stops once the tensors backward needs are back)
        assert len(calls) == (2 if checkpoint else 1), len(calls)
        expected = shifted[:, :, layer].reshape(-1, support.TOP_K).long()
        assert all(torch.equal(c, expected) for c in [*calls, *received[layer]]), layer
    assert gate_dtypes == {torch.float32}, gate_dtypes
    for i, gate in support.routers(net).items():
        grad = gate.weight.grad.full_tensor()
        assert grad.dtype == torch.float32 and torch.isfinite(grad).all()
        assert grad.abs().sum() > 0, f"layer {i}: the gate got no gradient"


def case_in_unit() -> None:
    _run("in_unit")


def case_separate_units_with_activation_checkpointing() -> None:
    _run("separate_units", checkpoint=True)


def case_in_unit_compiled() -> None:
    if not hasattr(torch, "compile"):  # pragma: no cover
        pytest.skip("torch.compile is unavailable")
    _run("in_unit", compile_units="aot_eager")


CASES = [
    "case_in_unit",
    "case_separate_units_with_activation_checkpointing",
    "case_in_unit_compiled",
]
results, test_replay_under_fsdp = distributed_suite(2, __name__, CASES)
