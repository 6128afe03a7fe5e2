"""QLoRA with the real packages (bitsandbytes 4-bit base, PEFT LoRA adapters), on 2 CPU ranks.

``from_pretrained(quantization_config=BitsAndBytesConfig(load_in_4bit=True, ...))`` stores each
quantized weight as a ``Params4bit`` of packed 4-bit codes in the ``bnb_4bit_quant_storage``
dtype; ``Linear4bit`` keeps its quant state on the module, so FSDP2 can shard the packed codes.
With ``model_policy`` the fp32 adapters stay in fp32 and the packed codes are never cast:

* ``uint8`` storage (the default) is non-floating, which FSDP never casts; torch 2.11 cannot
  manage it at all, and the refusal names ``ignored_params``, the way out tested here too.
* floating storage (fp16 here) is claimed in its storage dtype before any rule. A plain
  ``MixedPrecisionPolicy(bf16)`` casts the codes and silently computes with other weights (the
  negative control).

Every case compares loss and adapter gradients bitwise with the same model unwrapped.
"""

from __future__ import annotations

import shutil
import tempfile
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

import fsdp_precision as fp
from fsdp_precision.testing import GatherProbe

from tests.support.harness import collect_cases, distributed_suite
from tests.support.hf_models import tiny_llama

peft = pytest.importorskip("peft", reason="peft is not installed (pip install '.[peft]')")
transformers = pytest.importorskip("transformers", reason="transformers is not installed")
pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed (pip install '.[peft]')")

bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
RULES = fp.PrecisionRules(param_dtype=bf16, reduce_dtype=fp32, rules=(fp.Glob("*lora_*"),))
OLD_TORCH = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) < (2, 12)


def qlora_model(storage: torch.dtype) -> nn.Module:
    """A tiny Llama saved and reloaded in 4-bit NF4 (``storage`` packs the codes), with fp32
    LoRA adapters on q/v (PEFT's ``autocast_adapter_dtype``); the same on every call."""
    quantization = transformers.BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=bf16,
        bnb_4bit_quant_storage=storage,
    )  # fmt: skip
    where = [tempfile.mkdtemp() if dist.get_rank() == 0 else ""]
    dist.broadcast_object_list(where, src=0)  # transformers saves on rank 0 only
    try:
        if dist.get_rank() == 0:
            tiny_llama(
                64, hidden_size=64, intermediate_size=128, num_attention_heads=4
            ).save_pretrained(where[0])
        dist.barrier()
        base = transformers.LlamaForCausalLM.from_pretrained(
            where[0], quantization_config=quantization, dtype=bf16, device_map="cpu"
        )
        dist.barrier()
    finally:
        if dist.get_rank() == 0:
            shutil.rmtree(where[0], ignore_errors=True)
    torch.manual_seed(1)
    lora = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    # Train mode, as a trainer sets it: in eval mode bitsandbytes' CPU path repacks a weight in
    # place at its first no-grad forward and flags the shared quant state, which FSDP's next
    # all-gather of the original codes then contradicts (a CPU-only bitsandbytes behaviour).
    return peft.get_peft_model(base, lora, autocast_adapter_dtype=True).train()


def packed(model: nn.Module) -> list[str]:
    return [n for n, p in model.named_parameters() if type(p).__name__ == "Params4bit"]


def shard(model: nn.Module, policy: MixedPrecisionPolicy, **kwargs: Any) -> nn.Module:
    for layer in model.base_model.model.model.layers:
        fully_shard(layer, mp_policy=policy, **kwargs)
    fully_shard(model, mp_policy=policy, **kwargs)
    return model


def loss_and_grads(model: nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(2))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = {
        n: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        for n, p in model.named_parameters()
        if p.requires_grad
    }
    return loss.detach(), grads


def assert_bitwise(got: tuple[torch.Tensor, dict[str, Any]], ref: tuple[torch.Tensor, Any]) -> None:
    (loss, grads), (ref_loss, ref_grads) = got, ref
    assert torch.equal(loss, ref_loss), (loss, ref_loss)
    assert grads.keys() == ref_grads.keys() and grads
    for name, grad in grads.items():
        assert grad.dtype == ref_grads[name].dtype == fp32, name
        assert torch.equal(grad, ref_grads[name]), name


def gathered(model: nn.Module) -> dict[str, torch.dtype]:
    ids = torch.randint(0, 64, (1, 4), generator=torch.Generator().manual_seed(3))
    with GatherProbe(model) as probe, torch.no_grad():
        model(input_ids=ids)
    return {n: t.dtype for n, t in probe.seen.items()}


def case_uint8_storage_shards_and_trains_bitwise_like_unwrapped() -> None:
    reference = loss_and_grads(qlora_model(torch.uint8))
    model = qlora_model(torch.uint8)
    codes = packed(model)
    assert codes and all(dict(model.named_parameters())[n].dtype == torch.uint8 for n in codes)
    if OLD_TORCH:  # 2.11 makes every sharded parameter trainable: it cannot take uint8 codes
        with pytest.raises(fp.ParamDtypeMapError, match=r"non-floating parameters.*ignored_params"):
            shard(model, fp.model_policy(model, RULES))
        return
    shard(model, fp.model_policy(model, RULES))
    assert all(isinstance(p, DTensor) for p in model.parameters())  # FSDP2 sharded the codes
    seen = gathered(model)
    assert all(seen[n] == torch.uint8 for n in codes)
    assert all(d == fp32 for n, d in seen.items() if "lora_" in n)
    assert all(d == bf16 for n, d in seen.items() if "lora_" not in n and n not in codes)
    assert_bitwise(loss_and_grads(model), reference)


def case_ignored_params_is_the_way_out_for_uint8_codes() -> None:
    """The route the 2.11 refusal names, on every release: the codes stay whole on each rank."""
    reference = loss_and_grads(qlora_model(torch.uint8))
    model = qlora_model(torch.uint8)
    params = dict(model.named_parameters())
    codes = {params[n] for n in packed(model)}
    shard(model, fp.model_policy(model, RULES), ignored_params=codes)
    assert all(isinstance(p, DTensor) != (p in codes) for p in model.parameters())
    assert_bitwise(loss_and_grads(model), reference)


def case_floating_storage_is_never_cast() -> None:
    """fp16 codes in a bf16 policy: model_policy gathers them as fp16 (bitwise like unwrapped);
    the plain policy casts them to bf16 and silently computes another loss."""
    reference = loss_and_grads(qlora_model(fp16))
    model = qlora_model(fp16)
    codes = packed(model)
    policy = fp.model_policy(model, RULES)
    assert all(policy.param_dtype_map[n] == fp16 for n in codes)
    shard(model, policy)
    seen = gathered(model)
    assert codes and all(seen[n] == fp16 for n in codes)
    assert_bitwise(loss_and_grads(model), reference)
    plain = shard(qlora_model(fp16), MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32))
    wrong, _ = loss_and_grads(plain)
    assert not torch.equal(wrong, reference[0]), (wrong, reference[0])


def case_a_rule_aimed_at_packed_codes_is_refused() -> None:
    model = qlora_model(fp16)
    explained = fp.compile_param_dtype_maps(model, RULES, [model]).explain()
    assert "packed quantized storage (never cast) 'Params4bit'" in explained
    rules = fp.PrecisionRules(
        param_dtype=bf16, reduce_dtype=fp32, rules=(fp.Glob("*base_layer.weight"),)
    )
    with pytest.raises(
        fp.ParamDtypeMapError,
        match=r"precision rule glob '\*base_layer.weight' -> float32 \(rules\[0\]\) claims no "
        r"parameter: every parameter it matches \(4, e.g. '.*q_proj.base_layer.weight'\) was "
        r"claimed first by packed quantized storage \(never cast\) 'Params4bit' -> float16",
    ):
        fp.model_policy(model, rules)


CASES = collect_cases(globals())

results, test_qlora = distributed_suite(2, __name__, CASES)
