"""Weights to an engine in another process: the metadata first, then the tensors in their own
dtypes (``send_weights``/``receive_weights``), over gloo between processes.

Three ranks: 0 and 1 train a tiny Qwen3-MoE with FSDP2 (the router gates kept in fp32), 2 is the
engine; the weight group is ranks 0 and 2 (a registered group, or one of its own with a TCP store,
``weight_group``). Rank 1 takes part in every gather and receives nothing.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard

from fsdp_precision import Glob, PrecisionRules, full_weights, model_policy
from fsdp_precision._base.dist import free_port
from fsdp_precision._engines.transfer import (
    ALIGN,
    WireMeta,
    _layout,
    receive_tensors,
    send_tensors,
    wire_metas,
)
from fsdp_precision.integrations import receive_weights, send_weights, weight_group

from tests.support.harness import collect_cases, distributed_suite
from tests.support.hf_models import tiny_qwen3_moe

bf16, fp32 = torch.bfloat16, torch.float32
RULES = PrecisionRules(
    param_dtype=bf16, reduce_dtype=fp32, rules=(Glob("*.mlp.gate.weight"),), advice="off"
)
GATES = ("model.layers.0.mlp.gate.weight", "model.layers.1.mlp.gate.weight")
TRAINER, ENGINE = (0, 1), 2


class Counting:
    """A group that counts its broadcasts."""

    def __init__(self, group: Any) -> None:
        self.group, self.calls = group, 0

    def broadcast(self, tensors: list[torch.Tensor], opts: Any) -> Any:
        self.calls += 1
        return self.group.broadcast(tensors, opts)


def trainer_model() -> tuple[nn.Module | None, nn.Module]:
    """On the trainer ranks, the FSDP2 model over ranks 0 and 1; everywhere, its unsharded copy
    (the expected values)."""
    pytest.importorskip("transformers")
    model = tiny_qwen3_moe(fp32)
    g = torch.Generator().manual_seed(5)
    for name in GATES:  # values bf16 cannot hold
        model.get_parameter(name).data = torch.randn(model.get_parameter(name).shape, generator=g)
    reference = copy.deepcopy(model)
    trainers = dist.new_group(list(TRAINER))
    if dist.get_rank() == ENGINE:
        return None, reference
    mesh = DeviceMesh.from_group(trainers, "cpu")
    policy = model_policy(model, RULES)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model, reference


def exchange(group: Any, bucket_bytes: int) -> tuple[Any, nn.Module]:
    """Rank 0 sends, rank 1 drains, rank 2 receives everything; returns (what rank 2 received
    or None, the expected model)."""
    model, reference = trainer_model()
    if model is not None:
        stream = full_weights(model, ranks="rank0")
        if dist.get_rank() == 0:
            send_weights(stream, group, src=0, bucket_bytes=bucket_bytes)
        else:
            stream.drain()
        return None, reference
    received = receive_weights(group, src=0)
    return (received, list(received)), reference


def check_received(received: Any, reference: nn.Module) -> None:
    weights, tensors = received
    expected = full_weights(reference)  # unsharded and fp32: the same names and shapes
    assert [(m.name, m.shape) for m in weights.metadata] == [
        (m.name, m.shape) for m in expected.metadata
    ]
    # the plan's dtypes: the bulk as it computed (bf16), the gates as kept (fp32)
    assert {m.name: m.dtype for m in weights.metadata} == {
        m.name: fp32 if m.name in GATES else bf16 for m in expected.metadata
    }
    assert weights.kept == dict.fromkeys(GATES, fp32)
    assert len(tensors) == len(expected.metadata)
    for (name, tensor), (_, want) in zip(tensors, expected):
        assert torch.equal(tensor, want.to(tensor.dtype)), name  # the cast on the shard is exact
    gate = dict(tensors)[GATES[0]]
    assert gate.dtype == fp32 and torch.equal(gate, reference.get_parameter(GATES[0]).detach())


def case_a_registered_group_carries_the_kept_dtypes() -> None:
    pair = dist.new_group([0, ENGINE])
    if dist.get_rank() == 1:
        exchange(None, 4096)
        return
    counting = Counting(pair)
    received, reference = exchange(counting, 4096)
    if received is not None:
        check_received(received, reference)
        metas = [WireMeta(m.name, m.dtype, m.shape, m.kept) for m in received[0].metadata]
        assert counting.calls == 2 + len(_layout(metas, 4096))  # header, then one per bucket
        assert len(_layout(metas, 4096)) > 5


def case_a_group_of_its_own_outside_the_default_group() -> None:
    port = [free_port() if dist.get_rank() == 0 else 0]
    dist.broadcast_object_list(port, src=0)
    group = None
    if dist.get_rank() in (0, ENGINE):
        group = weight_group("127.0.0.1", port[0], 0 if dist.get_rank() == 0 else 1, 2)
    received, reference = exchange(group, 2**20)
    if received is not None:
        check_received(received, reference)


def case_a_header_that_is_not_the_library_s_is_refused() -> None:
    pair = dist.new_group([0, ENGINE])
    if dist.get_rank() == 0:
        raw = b'{"format": "something else"}'
        dist.broadcast(torch.tensor([len(raw)]), src=0, group=pair)
        dist.broadcast(torch.frombuffer(bytearray(raw), dtype=torch.uint8), src=0, group=pair)
    elif dist.get_rank() == ENGINE:
        with pytest.raises(
            ValueError,
            match=r"the weights' header is not 'fsdp_precision.weights/1': format 'something else'; send with send_weights",
        ):
            receive_weights(pair, src=0)


def case_the_metadata_from_elsewhere_then_the_tensors_alone() -> None:
    """vLLM's RL API carries the metadata in its own request: only the buckets travel here."""
    pair = dist.new_group([0, ENGINE])
    model, reference = trainer_model()
    expected = full_weights(reference)
    names = [m.name for m in expected.metadata]
    dtypes = ["float32" if n in GATES else "bfloat16" for n in names]
    metas = wire_metas(names, dtypes, [list(m.shape) for m in expected.metadata])
    if model is not None:
        stream = full_weights(model, ranks="rank0")
        if dist.get_rank() == 0:
            counting = Counting(pair)
            send_tensors(metas, stream, counting, src=0, bucket_bytes=4096)
            assert counting.calls == len(_layout(metas, 4096))  # no header: buckets only
        else:
            stream.drain()
        return
    received = list(receive_tensors(metas, pair, src=0, bucket_bytes=4096))
    assert [n for n, _ in received] == names
    for (name, tensor), (_, want) in zip(received, expected, strict=True):
        assert tensor.dtype == (fp32 if name in GATES else bf16), name
        assert torch.equal(tensor, want.to(tensor.dtype)), name


CASES = collect_cases(globals())

results, test_transfer = distributed_suite(3, __name__, CASES)


@pytest.mark.fast
def test_every_tensor_starts_aligned_whatever_precedes_it() -> None:
    metas = [
        WireMeta("odd", bf16, (3,), None),  # 6 bytes
        WireMeta("gate", fp32, (5,), "kept"),
        WireMeta("byte", torch.uint8, (1,), None),
        WireMeta("big", fp32, (64,), None),
    ]
    buckets = _layout(metas, 64)
    offsets = [(m.name, off) for bucket in buckets for m, off in bucket]
    assert offsets == [("odd", 0), ("gate", 16), ("byte", 48), ("big", 0)]
    assert all(off % ALIGN == 0 for _, off in offsets)
    # The negative control: at the unpadded offset the fp32 view breaks, as engines' buckets do.
    buffer = torch.zeros(36, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="storage_offset"):
        buffer[6:26].view(fp32)
    assert buffer[16:36].view(fp32).numel() == 5  # at the aligned one it holds


@pytest.mark.fast
def test_weight_group_refuses_a_bad_backend_or_rank() -> None:
    with pytest.raises(ValueError, match=r"backend='mpi'; pass 'gloo' \(CPU\) or 'nccl' \(GPU\)"):
        weight_group("127.0.0.1", 1, 0, 2, backend="mpi")
    with pytest.raises(ValueError, match=r"rank=2 is not in \[0, 2\)"):
        weight_group("127.0.0.1", 1, 2, 2)


@pytest.mark.fast
def test_a_bucket_smaller_than_the_alignment_is_refused_before_anything_is_sent() -> None:
    class Nothing:
        metadata: list[Any] = []

        def __iter__(self) -> Any:
            raise AssertionError("nothing may be gathered")

    with pytest.raises(ValueError, match=r"bucket_bytes=8; pass at least 16"):
        send_weights(Nothing(), group=None, bucket_bytes=8)


@pytest.mark.fast
def test_metadata_from_an_engine_s_request_is_checked_entry_by_entry() -> None:
    assert wire_metas(["a", "b"], ["float32", "torch.bfloat16"], [[2, 3], []]) == [
        WireMeta("a", fp32, (2, 3), None),
        WireMeta("b", bf16, (), None),
    ]
    with pytest.raises(ValueError, match=r"have 2, 1, 2 and 2 entries; pass one entry per tensor"):
        wire_metas(["a", "b"], ["float32"], [[1], [1]])
    with pytest.raises(ValueError, match=r"b: dtype 'complex64', shape \[1\]; pass a dtype among"):
        wire_metas(["a", "b"], ["float32", "complex64"], [[1], [1]])


@pytest.mark.fast
def test_a_source_that_disagrees_with_its_metadata_is_refused_before_its_bucket_is_sent() -> None:
    metas = [WireMeta("gate", fp32, (2,), "kept"), WireMeta("w", bf16, (3,), None)]
    narrowed = [("gate", torch.zeros(2, dtype=bf16)), ("w", torch.zeros(3, dtype=bf16))]
    with pytest.raises(
        ValueError,
        match=r"tensor 0: the source yielded 'gate' bfloat16 \(2,\), its metadata announced "
        r"'gate' float32 \(2,\)",
    ):
        send_tensors(metas, narrowed, group=None)  # no broadcast reached: the group is None
    with pytest.raises(ValueError, match=r"the source stopped after 1 tensors; its metadata"):
        send_tensors(metas, [("gate", torch.zeros(2))], group=None)
