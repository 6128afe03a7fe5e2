"""One focused case per way the architecture screen found a size-only auto-wrap breaking a model,
each on the smallest real model.

Each trains one step under ``wrap_model_for_training`` at the threshold where a size-only
auto-wrap picks a unit that torch cannot run (2 gloo ranks); all fail on a size-only auto-wrap:

* a module used outside its unit's forward: LLaVA calls ``get_input_embeddings()(input_ids)``
  in the outer model while the language model unit owns ``embed_tokens`` (25% threshold:
  "aten.embedding.default got mixed torch.Tensor and DTensor");
* a parameter read outside any forward of its unit: SmolVLM casts image features to
  ``self.dtype``, the fp32 storage dtype of a parameter in a non-root unit, while the text side
  computes in bf16 (threshold 0: "masked_scatter: expected self and source to have same
  dtypes"); DeBERTa-v2's encoder reads ``rel_embeddings.weight`` without calling that module
  (threshold 0: "aten.addmm.default got mixed torch.Tensor and DTensor");
* a 0-dim parameter: CLIP's ``logit_scale``, which ``fully_shard`` refuses at the root call,
  after the inner units are sharded. Either it trains, or the refusal comes before anything is
  sharded (no parameter is a DTensor afterwards) and names the parameter;
* BLIP-2 with OPT, whose embedding is tied to ``lm_head`` and so never its own unit (25%);
* a wrapped module whose class transformers looks up by name: ``fully_shard`` swaps LLaVA's
  vision tower to ``FSDPCLIPVisionModel``, and transformers 5's output recording (keyed by class
  name) recorded no hidden states ("'NoneType' object is not subscriptable").
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import fsdp_precision as fp

from tests.support.harness import collect_cases, distributed_suite
from tests.support.screen_models import (
    ARCHS,
    LR,
    ScreenArch,
    batch_of,
    build,
    threshold,
    train_unwrapped,
)

LOSS_RTOL = 0.05  # bf16 compute against the unwrapped fp32 model


def _config(arch: ScreenArch, model: torch.nn.Module, fraction: float) -> fp.DistributedConfig:
    return fp.DistributedConfig(
        parallel_strategy="fsdp",
        fsdp_mixed_precision=fp.PrecisionRules(rules=arch.rules),  # bf16, fp32 reduce
        fsdp_auto_wrap_min_params=threshold(model, fraction),
    )


def one_step(name: str, fraction: float) -> None:
    """Wrap ``name`` at ``fraction`` of its size and train one step: the loss is finite and
    matches the unwrapped model's within bf16 tolerance."""
    arch = ARCHS[name]
    rank = dist.get_rank()
    reference, _ = train_unwrapped(arch, rank)
    model = build(arch)
    model = fp.wrap_model_for_training(model, _config(arch, model, fraction))
    optim = torch.optim.AdamW(model.parameters(), lr=LR)
    loss = arch.loss(model, batch_of(arch, 0, rank))
    loss.backward()  # type: ignore[no-untyped-call]
    optim.step()
    assert math.isfinite(loss.item()), loss
    assert abs(loss.item() - reference[0]) <= LOSS_RTOL * max(1.0, abs(reference[0])), (
        f"loss {loss.item()} vs unwrapped fp32 {reference[0]}"
    )


def case_module_used_outside_its_unit_llava() -> None:
    one_step("llava", 0.25)


def case_param_read_outside_forward_smolvlm_dtype() -> None:
    one_step("smolvlm", 0.0)


def case_param_read_outside_forward_deberta_rel_embeddings() -> None:
    one_step("deberta_v2", 0.0)


def case_scalar_param_clip_logit_scale() -> None:
    arch = ARCHS["clip"]
    model = build(arch)
    assert model.get_parameter("logit_scale").dim() == 0  # as transformers builds it
    try:
        fp.wrap_model_for_training(model, _config(arch, model, 0.0))
    except (ValueError, RuntimeError) as exc:
        sharded = [k for k, p in model.named_parameters() if isinstance(p, DTensor)]
        assert not sharded, (
            f"a refused wrap left {len(sharded)} of {len(list(model.parameters()))} parameters "
            f"sharded (e.g. {sharded[:3]}): {exc}"
        )
        assert "logit_scale" in str(exc), f"the refusal does not name logit_scale: {exc}"
        return
    one_step("clip", 0.0)


def case_blip2_opt_tied_embedding() -> None:
    one_step("blip2_opt", 0.25)


def case_wrapped_vision_tower_still_records_hidden_states() -> None:
    from torch.distributed.fsdp import fully_shard

    arch = ARCHS["llava"]
    model = build(arch)
    units = [model.model.vision_tower, model.model, model]
    fp.compile_param_dtype_maps(model, fp.DistributedConfig().precision(), units).apply()
    assert math.isfinite(arch.loss(model, batch_of(arch, 0, dist.get_rank())).item())
    # Negative control: the same units through plain fully_shard, without the registration
    # (earlier cases in this process registered the FSDP class names), lose the recording.
    from transformers.utils.output_capturing import _CAN_RECORD_REGISTRY

    plain = build(arch)
    for module in [plain.model.vision_tower, plain.model, plain]:
        fully_shard(module)
        dict.pop(_CAN_RECORD_REGISTRY, str(type(module)), None)
    try:
        arch.loss(plain, batch_of(arch, 0, dist.get_rank()))
    except TypeError as exc:
        assert "'NoneType' object is not subscriptable" in str(exc), exc
    else:
        raise AssertionError("plain fully_shard kept the hidden states: the control is void")


def case_vision_tower_records_hidden_states_under_framework_calls() -> None:
    """The same through model_policy, with the calls a framework makes itself (accelerate and
    the others never go through PrecisionPlan.apply): the construction step registers the
    swapped class at its first forward."""
    from torch.distributed.fsdp import fully_shard
    from transformers.utils.output_capturing import _CAN_RECORD_REGISTRY

    arch = ARCHS["llava"]
    model = build(arch)
    policy = fp.model_policy(model, fp.PrecisionRules(rules=arch.rules))
    assert policy.param_dtype_map  # a mapped policy: the calls take the patched path
    for module in [model.model.vision_tower, model.model, model]:
        fully_shard(module, mp_policy=policy)
        dict.pop(_CAN_RECORD_REGISTRY, str(type(module)), None)  # no earlier registration
    assert math.isfinite(arch.loss(model, batch_of(arch, 0, dist.get_rank())).item())


CASES = collect_cases(globals())

results, test_regression = distributed_suite(2, __name__, CASES)
