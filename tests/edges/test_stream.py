"""``full_weights``: the full weights of an FSDP2 model unit by unit, in the plan's dtypes, in
Hugging Face checkpoint names; what an inference engine's ``load_weights`` receives.

Two gloo ranks, a tiny Qwen3-MoE (transformers 5 fuses its experts in memory; the stream yields
them per expert, as on the Hub) with its router gates kept in fp32 by one ``model_policy``.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard

from fsdp_precision import Glob, PrecisionRules, full_weights, model_policy

from tests.support.engine import load_weights
from tests.support.harness import distributed_suite
from tests.support.hf_models import tiny_qwen3_moe

pytestmark = pytest.mark.distributed
bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
RULES = PrecisionRules(
    param_dtype=bf16, reduce_dtype=fp32, rules=(Glob("*.mlp.gate.weight"),), advice="off"
)
GATES = ("model.layers.0.mlp.gate.weight", "model.layers.1.mlp.gate.weight")


def wrapped(dtype: torch.dtype = fp32, **config: object) -> tuple[nn.Module, nn.Module]:
    """(the FSDP2 model, an unsharded copy taken before wrapping)."""
    pytest.importorskip("transformers")
    model = tiny_qwen3_moe(dtype, **config)
    reference = copy.deepcopy(model)
    policy = model_policy(model, RULES)
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model, reference


def on_disk(reference: nn.Module) -> dict[str, torch.Tensor]:
    """The reference's state dict as transformers saves it (experts per expert)."""
    from transformers.core_model_loading import revert_weight_conversion

    return dict(revert_weight_conversion(reference, dict(reference.state_dict())))


def ids(seed: int = 7) -> torch.Tensor:
    return torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(seed))


def case_stream_is_the_model_in_checkpoint_names() -> None:
    model, reference = wrapped()
    expected = on_disk(reference)
    stream = full_weights(model, dtype="stored")
    got = list(stream)
    assert [n for n, _ in got] == [m.name for m in stream.metadata]  # told before, in order
    assert {n for n, _ in got} == set(expected)
    assert "model.layers.0.mlp.experts.3.up_proj.weight" in expected  # per expert, as on disk
    for (name, tensor), meta in zip(got, stream.metadata):
        assert (tensor.dtype, tuple(tensor.shape)) == (meta.dtype, meta.shape), name
        assert tensor.dtype == fp32 and torch.equal(tensor, expected[name]), name
    assert stream.nbytes == sum(t.numel() * t.element_size() for _, t in got)


def case_dtypes_follow_the_plan() -> None:
    model, reference = wrapped()
    expected = on_disk(reference)
    compute = full_weights(model)  # "compute": the bulk as computed (bf16), the gates fp32
    assert compute.bulk == bf16 and set(compute.kept) == set(GATES)
    assert all("glob '*.mlp.gate.weight'" in str(m.kept) for m in compute.kept.values())
    for name, tensor in compute:
        want = fp32 if name in GATES else bf16
        assert tensor.dtype == want and torch.equal(tensor, expected[name].to(want)), name
    for name, tensor in full_weights(model, dtype=fp16):  # an fp16 engine: the gates stay fp32
        assert tensor.dtype == (fp32 if name in GATES else fp16), name
    rounded = dict(full_weights(model, dtype=bf16, cast_kept=True))  # one dtype for all
    assert all(t.dtype == bf16 for t in rounded.values())
    assert not torch.equal(rounded[GATES[0]].float(), expected[GATES[0]])  # what keeping saves


def case_a_bf16_checkpoint_streams_its_upcast_gates() -> None:
    model, reference = wrapped(bf16)  # the policy upcast the stored gates exactly
    expected = on_disk(reference)
    for name, tensor in full_weights(model, dtype="stored"):
        assert tensor.dtype == (fp32 if name in GATES else bf16), name
        assert torch.equal(tensor.float(), expected[name].float()), name


def case_rank0_alone_receives() -> None:
    model, _ = wrapped()
    stream = full_weights(model, ranks="rank0")
    got = list(stream)
    assert len(got) == (len(stream.metadata) if dist.get_rank() == 0 else 0)
    full_weights(model, ranks="rank0").drain()  # every rank takes part; nothing kept


def case_ranks_that_receive_nothing_copy_nothing() -> None:
    """With ``device=`` (the export's host), only the receiving rank copies there (issue 53:
    every rank copied every full tensor to its host, then dropped it)."""
    from fsdp_precision._edges import stream as stream_module

    model, _ = wrapped()
    copies: list[int] = []
    real = stream_module.to_device

    def counting(tensors: dict[str, torch.Tensor], device: torch.device) -> dict:
        copies.append(len(tensors))
        return real(tensors, device)

    stream_module.to_device = counting  # type: ignore[assignment]
    try:
        got = dict(full_weights(model, ranks="rank0", device="cpu"))
    finally:
        stream_module.to_device = real  # type: ignore[assignment]
    if dist.get_rank() == 0:
        assert copies and got and all(t.device.type == "cpu" for t in got.values())
    else:
        assert copies == [] and got == {}


def case_tied_embedding_once() -> None:
    model, _ = wrapped(tie_word_embeddings=True)
    names = [m.name for m in full_weights(model).metadata]
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names


def case_engine_consumer_matches_the_trained_logits() -> None:
    model, _ = wrapped()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(2):
        batch = ids(dist.get_rank() * 10 + step)
        model(input_ids=batch, labels=batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    with torch.no_grad():
        trained = model(input_ids=ids()).logits
    for cast_kept in (False, True):  # True: the negative control, the gates rounded to bf16
        stream = full_weights(model, dtype=bf16, cast_kept=cast_kept, ranks="rank0")
        if dist.get_rank() != 0:
            stream.drain()
            continue
        engine = tiny_qwen3_moe(bf16, seed=1).eval()  # other weights: all must come from the stream
        kept = {name: meta.dtype for name, meta in stream.kept.items()}
        assert load_weights(engine, stream, kept) == {m.name for m in stream.metadata}
        if not cast_kept:  # the routers' input cast to fp32, as in training
            assert stream.install_casts(engine) == [
                "model.layers.0.mlp.gate",
                "model.layers.1.mlp.gate",
            ]
        with torch.no_grad():
            served = engine(input_ids=ids()).logits
        assert torch.equal(served, trained) != cast_kept, f"cast_kept={cast_kept}"


def case_load_into_a_copy_computes_as_trained_and_refuses_another_shape() -> None:
    model, _ = wrapped()
    with torch.no_grad():
        trained = model(input_ids=ids()).logits
    copy_ = tiny_qwen3_moe(bf16, seed=1).eval()  # a bf16 copy, as an evaluation or reference model
    other = tiny_qwen3_moe(bf16, num_experts=2)
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(ValueError, match=r"the stream does not fit Qwen3MoeForCausalLM: .*shapes"):
        full_weights(model, dtype=bf16, layout="plain").load_into(other)
    assert all(torch.equal(before[k], v) for k, v in other.state_dict().items())  # untouched
    stream = full_weights(model, dtype=bf16, layout="plain")  # the copy's own (fused) names
    assert len(stream.load_into(copy_)) == len(stream)
    assert copy_.get_parameter(GATES[0]).dtype == fp32  # allocated in its kept dtype
    with torch.no_grad():
        assert torch.equal(copy_(input_ids=ids()).logits, trained)


CASES = [
    "case_stream_is_the_model_in_checkpoint_names",
    "case_dtypes_follow_the_plan",
    "case_a_bf16_checkpoint_streams_its_upcast_gates",
    "case_rank0_alone_receives",
    "case_ranks_that_receive_nothing_copy_nothing",
    "case_tied_embedding_once",
    "case_engine_consumer_matches_the_trained_logits",
    "case_load_into_a_copy_computes_as_trained_and_refuses_another_shape",
]
results, test_two_ranks = distributed_suite(2, __name__, CASES)
