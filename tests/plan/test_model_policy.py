"""model_policy: one policy object for every fully_shard call on a model.

Each call resolves the entries of the parameters it manages by slot (module + attribute), in
any order and grouping; what frameworks do before wrapping (meta round trips, ties, ignored
parameters) keeps working; entries no call claimed are an error once the root is wrapped."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from fsdp_precision import (
    Glob,
    ParamDtypeMapError,
    ParamDtypeMixedPrecisionPolicy,
    PrecisionRules,
    compile_param_dtype_maps,
    model_policy,
)
from fsdp_precision.testing import GatherProbe

from tests.support.harness import collect_cases, distributed_suite
from tests.support.models import Net, bf16, fp32, inputs, net, train_in_lockstep

KEEP = (Glob("*norm.weight"), Glob("*norm.bias"), Glob("*gate.weight"))
RULES = PrecisionRules(param_dtype=bf16, reduce_dtype=fp32, rules=KEEP)


def kept(fqn: str) -> bool:
    return fqn.endswith(("norm.weight", "norm.bias", "gate.weight"))


def gathered(model: nn.Module) -> dict[str, torch.dtype]:
    with GatherProbe(model) as probe:
        model(inputs(0))
    return {fqn: g.dtype for fqn, g in probe.seen.items()}


def assert_kept_in_fp32(model: nn.Module) -> None:
    seen = gathered(model)
    assert len(seen) == len(list(model.named_parameters())), sorted(seen)
    for fqn, dtype in seen.items():
        assert dtype == (fp32 if kept(fqn) else bf16), (fqn, dtype)


# ---------------------------------------------------------------------- one process


def test_policy_is_hashable_comparable_and_shows_root_relative_entries() -> None:
    model = net()
    policy = model_policy(model, RULES)
    assert isinstance(policy, ParamDtypeMixedPrecisionPolicy)
    assert hash(policy) == hash(policy) and policy == copy.copy(policy)
    assert policy != model_policy(model, RULES)  # another scope: claims are per policy
    assert set(policy.param_dtype_map) == {n for n, _ in model.named_parameters() if kept(n)}
    assert {policy: 1}[policy] == 1


def test_policy_pickles_as_the_plain_policy_it_reads_as_and_copies_as_itself() -> None:
    """The HF Trainer ``torch.save``s its arguments (the policy in ``fsdp_plugin_args``) into
    every checkpoint; Lightning pickles hyperparameters. The scope holds weak references to the
    model's modules, which pickle refuses: the policy pickles as a record instead."""
    model = net()
    policy = model_policy(model, RULES)
    with pytest.raises(TypeError, match=r"cannot pickle 'weakref"):
        pickle.dumps(policy.scope)  # why the policy needs its own reduction
    record = pickle.loads(pickle.dumps(policy))
    assert type(record) is ParamDtypeMixedPrecisionPolicy
    assert dict(record.param_dtype_map) == dict(policy.param_dtype_map)
    assert dict(record.module_casts) == dict(policy.module_casts)
    assert (record.param_dtype, record.reduce_dtype, record.cast_forward_inputs) == (
        bf16,
        fp32,
        True,
    )
    # Frameworks copy their arguments: a copy is the live policy, whose scope every call shares.
    assert copy.copy(policy) is policy and copy.deepcopy(policy) is policy
    assert copy.deepcopy({"mp": policy})["mp"] is policy


def test_rules_are_checked_when_the_policy_is_built() -> None:
    rules = PrecisionRules(param_dtype=bf16, reduce_dtype=fp32, rules=(Glob("*nope*"),))
    with pytest.raises(
        ParamDtypeMapError,
        match=r"precision rule glob '\*nope\*' -> float32 matches no parameter of Net",
    ):
        model_policy(net(), rules)
    with pytest.warns(DeprecationWarning, match=r"strategy='split'\) is deprecated"):
        split = PrecisionRules(param_dtype=bf16, reduce_dtype=fp32, rules=KEEP, strategy="split")
    with pytest.raises(ValueError, match=r"model_policy cannot plan separate units"):
        model_policy(net(), split)


# ---------------------------------------------------------------------- two ranks


def _orders(model: Net) -> dict[str, list[nn.Module]]:
    blocks = list(model.blocks)
    return {
        "innermost first": [*blocks, model],
        "head first, blocks reversed": [model.head, *reversed(blocks), model],
        "root only": [model],
    }


def case_any_call_order_gathers_the_kept_parameters_in_fp32() -> None:
    for order, _ in _orders(net()).items():
        model = net()
        policy = model_policy(model, RULES)
        for module in _orders(model)[order]:
            fully_shard(module, mp_policy=policy)  # the same object for every call
        assert_kept_in_fp32(model)


def case_model_policy_is_bitwise_equal_to_per_call_maps() -> None:
    scoped, per_call = net(), net()
    policy = model_policy(scoped, RULES)
    for module in _orders(scoped)["head first, blocks reversed"]:
        fully_shard(module, mp_policy=policy)
    units = _orders(per_call)["head first, blocks reversed"]
    compile_param_dtype_maps(per_call, RULES, units).apply()
    train_in_lockstep([scoped, per_call], steps=2)


def case_grouped_call_never_broadcasts_to_a_sibling() -> None:
    model = net()
    policy = model_policy(model, RULES)
    for block in model.blocks:
        fully_shard(block, mp_policy=policy)
    fully_shard([model.norm, model.head], mp_policy=policy)  # both hold a local "weight"
    fully_shard(model, mp_policy=policy)
    seen = gathered(model)
    assert seen["norm.weight"] == fp32 and seen["head.weight"] == bf16, seen
    # Negative control: a per-call map's key reaches every member of a grouped call.
    from fsdp_precision._policy.resolve import resolve_param_dtype_map

    plain = net()
    broadcast = ParamDtypeMixedPrecisionPolicy(
        param_dtype=bf16, reduce_dtype=fp32, param_dtype_map={"weight": fp32}
    )
    members = [plain.norm, plain.head]
    resolved = resolve_param_dtype_map(
        members, [p for m in members for p in m.parameters()], broadcast
    )
    assert set(resolved.by_param) == {id(plain.norm.weight), id(plain.head.weight)}


def case_meta_round_trip_keeps_the_entries() -> None:
    model = net()
    state = copy.deepcopy(model.state_dict())
    policy = model_policy(model, RULES)  # built on the real model, as a framework would
    model.to("meta")  # accelerate's cpu_ram_efficient_loading: new parameter objects
    for block in model.blocks:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    model.to_empty(device="cpu")
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True))
    assert_kept_in_fp32(model)


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, 32, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.embed(ids).to(self.norm.weight.dtype))
        return self.head(h.to(self.head.weight.dtype))  # a kept head computes in its dtype


def case_tied_weights_resolve_through_either_slot() -> None:
    torch.manual_seed(0)
    model = Tied()
    rules = PrecisionRules(param_dtype=bf16, reduce_dtype=fp32, rules=(Glob("embed.weight"),))
    policy = model_policy(model, rules)
    fully_shard(model.norm, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    with GatherProbe(model) as probe:
        model(torch.tensor([[1, 2, 3]]))
    assert probe.seen["embed.weight"].dtype == fp32 and probe.seen["head.weight"].dtype == fp32
    assert probe.seen["norm.weight"].dtype == bf16


def case_never_claimed_entries_are_an_error_at_the_root() -> None:
    model = net()
    policy = model_policy(model, RULES)
    fully_shard(model.blocks[0], mp_policy=MixedPrecisionPolicy(param_dtype=bf16))
    fully_shard(model.blocks[1], mp_policy=policy)
    with pytest.raises(ParamDtypeMapError) as error:
        fully_shard(model, mp_policy=policy)
    assert str(error.value) == (
        "model_policy entries of Net were resolved by no fully_shard call by the time the root "
        "was wrapped: 'blocks.0.gate.weight': wrapped by a fully_shard call with another "
        "mp_policy; 'blocks.0.norm.bias': wrapped by a fully_shard call with another mp_policy; "
        "'blocks.0.norm.weight': wrapped by a fully_shard call with another mp_policy. Pass the "
        "model_policy to every fully_shard call on the model, keep kept parameters out of "
        "ignored_params, and build the policy on the model you wrap"
    )
    # The same entry taken out by ignored_params, and a policy built on another model.
    model = net()
    policy = model_policy(model, RULES)
    with pytest.raises(ParamDtypeMapError, match=r"'norm.weight': in ignored_params \(never"):
        fully_shard(model, mp_policy=policy, ignored_params={model.norm.weight})
    with pytest.raises(ParamDtypeMapError, match=r"this model_policy was built for a Net, and "):
        fully_shard(net(), mp_policy=model_policy(net(), RULES))  # another Net
    model = net()
    policy = model_policy(model, RULES)
    model.norm = nn.LayerNorm(16)  # replaced after the policy was built
    with pytest.raises(ParamDtypeMapError, match=r"this model_policy was built for a Net"):
        fully_shard(model.norm, mp_policy=policy)
    with pytest.raises(ParamDtypeMapError, match=r"modules created after this model_policy"):
        fully_shard(model, mp_policy=policy)


def case_parameters_of_modules_created_later_are_refused_where_they_are_wrapped() -> None:
    """A module added after the policy was built (PEFT's adapters, a quantized replacement)
    has no entry: its parameters would silently take param_dtype. The first call that manages
    one refuses, naming them, before anything is sharded."""
    model = net()
    policy = model_policy(model, RULES)
    model.blocks[0].adapter = nn.Linear(16, 16)  # e.g. get_peft_model after model_policy
    with pytest.raises(ParamDtypeMapError) as error:
        fully_shard(model.blocks[0], mp_policy=policy)
    assert str(error.value) == (
        "fully_shard manages parameters of modules created after this model_policy was built "
        "for Net: 'adapter.weight' (Linear), 'adapter.bias' (Linear); the policy has no entry "
        "for them, so they would silently take param_dtype. Build the policy with "
        "model_policy(model, rules) after every module replacement (PEFT's get_peft_model, "
        "quantization, float8 conversion), on the model you wrap"
    )
    assert not any(isinstance(p, DTensor) for p in model.parameters())  # refused first
    # The way out: the policy built after the module was added; a rule can then keep it.
    rules = PrecisionRules(param_dtype=bf16, reduce_dtype=fp32, rules=(*KEEP, Glob("*adapter*")))
    policy = model_policy(model, rules)
    for module in [*model.blocks, model]:
        fully_shard(module, mp_policy=policy)
    with GatherProbe(model) as probe:
        model(inputs(0))
    assert probe.seen["blocks.0.adapter.weight"].dtype == fp32
    # A module created later that registers an existing parameter (a tie) adds no parameter.
    model = net()
    policy = model_policy(model, RULES)
    alias = nn.Module()
    alias.register_parameter("weight", model.blocks[0].gate.weight)
    model.blocks[0].alias = alias
    for module in [*model.blocks, model]:
        fully_shard(module, mp_policy=policy)
    assert gathered(model)["blocks.0.gate.weight"] == fp32


class Outer(nn.Module):
    """A wrapper with no parameter of its own around the model (like PEFT's PeftModel)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


def case_wrappers_without_parameters_are_accepted() -> None:
    """Activation-checkpoint wrappers around the blocks and a wrapper around the root, all
    made after the policy: they register no parameter, so every entry still resolves, and the
    root's never-claimed check still runs through the outer wrapper."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = net()
    policy = model_policy(model, RULES)
    for i, block in enumerate(list(model.blocks)):
        model.blocks[i] = checkpoint_wrapper(block)
    outer = Outer(model)
    for module in [*model.blocks, outer]:
        fully_shard(module, mp_policy=policy)
    assert_kept_in_fp32(outer)
    model = net()
    policy = model_policy(model, RULES)
    fully_shard(model.blocks[0], mp_policy=MixedPrecisionPolicy(param_dtype=bf16))
    with pytest.raises(ParamDtypeMapError, match=r"'blocks.0.gate.weight': wrapped by a "):
        fully_shard(Outer(model), mp_policy=policy)


def case_a_call_that_refuses_claims_nothing() -> None:
    """An entry outside a call is no error there; each call claims exactly its own entries."""
    model = net()
    policy = model_policy(model, RULES)
    fully_shard(model.head, mp_policy=policy)  # holds no entry: fine
    fully_shard(model.blocks[0], mp_policy=policy)
    assert policy.scope is not None  # type: ignore[attr-defined]
    assert policy.scope.resolved == {  # type: ignore[attr-defined]
        "blocks.0.norm.weight", "blocks.0.norm.bias", "blocks.0.gate.weight"
    }  # fmt: skip


CASES = collect_cases(globals())

results, test_two_ranks = distributed_suite(2, __name__, CASES)
