"""One engine model's kept tensors, without the engine: ``Held`` finds each kept tensor among the
built model's parameters, converts a kept norm (its weight re-allocated in the kept dtype, its
module given the recorded boundary cast), refuses by name what it cannot hold, and reads every
kept tensor back after a load (where a kernel hides the weight, through the module's forward).

The model stands in for a vLLM model at the level ``Held`` sees it: named modules and parameters,
a router built in fp32 by the layer replacement (here: by hand), a norm built in bf16, a fused
``qkv`` the checkpoint names ``q``/``k``/``v``, and a linear layer whose kernel holds its weight.
"""

from __future__ import annotations

from collections.abc import Iterable

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fsdp_precision import EngineDtypeError, ModuleCast
from fsdp_precision._edges.record import RecordedCast
from fsdp_precision._engines.kept import EngineKept
from fsdp_precision._engines.vllm.hold import Held, build, building
from fsdp_precision._policy.casts import installed_cast

pytestmark = pytest.mark.fast
bf16, fp32 = torch.bfloat16, torch.float32


class Packed(nn.Module):
    """A linear layer whose weight a kernel holds after ``pack()`` (vLLM's CPU prepack): the
    parameter becomes empty, the computation a closure over the packed copy."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(4, 8, dtype=dtype), requires_grad=False)
        self.kernel: torch.Tensor | None = None

    def pack(self) -> None:
        self.kernel = self.weight.detach().t().contiguous()
        self.weight = nn.Parameter(torch.empty(0, dtype=self.weight.dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        assert self.kernel is not None
        return (x.to(self.kernel.dtype) @ self.kernel).to(self.kernel.dtype), None


class Engine(nn.Module):
    def __init__(self, gate_dtype: torch.dtype = fp32) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8, dtype=bf16)  # built in the model dtype
        self.qkv = nn.Linear(8, 24, dtype=bf16)  # the checkpoint's q/k/v, fused
        self.gate = Packed(gate_dtype)  # built in its kept dtype (the layer replacement)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        loaded = set()
        for name, tensor in weights:
            params[name].data.copy_(tensor)  # what every engine loader ends in
            loaded.add(name)
        return loaded


def kept(*names: str, casts: tuple[RecordedCast, ...] = ()) -> EngineKept:
    return EngineKept(tensors=dict.fromkeys(names, fp32), casts=casts, bulk=bf16, source="test")


NORM_CAST = RecordedCast("norm", ModuleCast(fp32, outputs=True), bf16)


def held(kept_: EngineKept, gate_dtype: torch.dtype = fp32) -> tuple[Engine, Held]:
    """Build ``Engine`` as the integration's model class builds vLLM's (checkpoint ``q`` maps to
    the engine's fused ``qkv``)."""
    rename = {"q.weight": "qkv.weight"}.get
    with build(kept_, "Toy", lambda n: rename(n, n), lambda n: n == "q.weight") as current:
        assert building() is current
        model = Engine(gate_dtype)
    assert building() is None
    return model, Held(model, current)


def test_a_kept_norm_is_converted_and_given_its_recorded_cast() -> None:
    model, state = held(kept("norm.weight", "norm.bias", "gate.weight", casts=(NORM_CAST,)))
    assert state.converted == ["norm.bias", "norm.weight"]
    assert model.norm.weight.dtype == fp32 and model.norm.bias.dtype == fp32
    assert installed_cast(model.norm) == ModuleCast(fp32, outputs=True)
    x = torch.randn(3, 8).to(bf16)
    out = model.norm(x)
    assert out.dtype == bf16  # cast back, as training's unit did
    expected = F.layer_norm(x.float(), (8,), model.norm.weight, model.norm.bias).to(bf16)
    assert torch.equal(out, expected)


@pytest.mark.parametrize(
    ("names", "casts", "match"),
    [
        (
            ("q.weight",),
            (),
            r"q.weight: vLLM's Toy loads it as one shard of the fused 'qkv.weight', held in the bulk dtype bfloat16",
        ),
        (
            ("norm.weight",),
            (),
            r"norm.weight: vLLM's LayerNorm 'norm' holds it in bfloat16, and training recorded no boundary cast",
        ),
        (("missing.weight",), (), r"missing.weight: vLLM's Toy holds no tensor of that name"),
    ],
    ids=["fused", "no cast recorded", "absent"],
)
def test_what_the_engine_cannot_hold_is_refused_by_name_at_build(
    names: tuple[str, ...], casts: tuple[RecordedCast, ...], match: str
) -> None:
    with pytest.raises(
        EngineDtypeError, match=r"^vLLM cannot hold what training kept \(test\): " + match
    ):
        held(kept(*names, casts=casts))


def test_a_kept_gate_built_in_fp32_loads_exactly_and_is_probed_once_packed() -> None:
    model, state = held(kept("gate.weight"))
    weight = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    state.load(model, model.load_weights, [("gate.weight", weight)], lambda n: n)  # readable
    model.gate.pack()
    state.check(model, {"gate.weight": weight}, lambda n: n)  # hidden: probed, exact


def test_a_gate_the_engine_rounded_is_named_readable_or_hidden() -> None:
    model, state = held(kept("gate.weight"))
    model.gate.weight.data = model.gate.weight.data.to(bf16)  # an engine that rounds
    weight = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    with pytest.raises(
        EngineDtypeError,
        match=r"vLLM rounded what training kept .*gate.weight: the engine holds it in bfloat16, training kept it in float32",
    ):
        state.load(model, model.load_weights, [("gate.weight", weight)], lambda n: n)
    model.gate.pack()
    with pytest.raises(
        EngineDtypeError, match=r"gate.weight: the engine computes its module's output in bfloat16"
    ):
        state.check(model, {"gate.weight": weight}, lambda n: n)


def held_with(kept_: EngineKept, **options: object) -> tuple[Engine, Held]:
    """``held`` with :class:`Held`'s options (the engine's dtype, pipeline stages, first load)."""
    engine_dtype = options.pop("engine_dtype", None)
    with build(kept_, "Toy", lambda n: n, engine_dtype=engine_dtype) as current:  # type: ignore[arg-type]
        model = Engine()
    return model, Held(model, current, **options)  # type: ignore[arg-type]


GATE = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("sent", [bf16, torch.float16], ids=["bf16", "fp16"])
def test_an_update_bringing_a_kept_tensor_narrower_is_refused_by_name(sent: torch.dtype) -> None:
    """The narrower kept tensor never reaches the engine's loader (it keeps its values); the
    rest of the call loads (an in-place reload must see its end), then the refusal is raised."""
    model, state = held_with(kept("gate.weight"))
    before = model.gate.weight.detach().clone()
    qkv = torch.randn(24, 8).to(bf16)
    name = str(sent).removeprefix("torch.")
    with pytest.raises(
        EngineDtypeError,
        match=rf"in a narrower dtype \(those were not loaded.*gate.weight: sent in {name}, kept in float32",
    ):
        weights = [("gate.weight", GATE.to(sent)), ("qkv.weight", qkv)]
        state.load(model, model.load_weights, weights, lambda n: n)
    assert torch.equal(model.gate.weight, before)  # never reached the engine's loader
    assert torch.equal(model.qkv.weight, qkv)  # the rest of the call did


def test_a_wider_or_equal_kept_tensor_loads_exactly() -> None:
    model, state = held_with(kept("gate.weight"))
    state.load(model, model.load_weights, [("gate.weight", GATE.double())], lambda n: n)
    assert torch.equal(model.gate.weight, GATE.double().float())
    state.load(model, model.load_weights, [("gate.weight", GATE)], lambda n: n)
    assert torch.equal(model.gate.weight, GATE)


def test_the_first_load_of_a_base_checkpoint_widens_its_bf16_router_once() -> None:
    """A base checkpoint stores the router in bf16: the engine's first load widens it exactly;
    an update after that must bring fp32 (negative control: the same tensor, refused)."""
    model, state = held_with(kept("gate.weight"), checkpoint_load=True)
    base = GATE.to(bf16)
    state.load(model, model.load_weights, [("gate.weight", base)], lambda n: n)
    assert model.gate.weight.dtype == fp32 and torch.equal(model.gate.weight, base.float())
    with pytest.raises(EngineDtypeError, match=r"gate.weight: sent in bfloat16, kept in float32"):
        state.load(model, model.load_weights, [("gate.weight", base)], lambda n: n)
    assert torch.equal(model.gate.weight, base.float())


def test_a_pipeline_stage_checks_only_what_it_holds() -> None:
    """Each stage holds some layers (vLLM's ``PPMissingLayer`` elsewhere): a kept tensor of
    another stage is neither refused at build nor read back; one this stage should hold and
    does not is still refused (negative control)."""
    names = ("gate.weight", "layers.9.norm.weight")
    model, state = held_with(kept(*names), elsewhere=lambda n: n.startswith("layers.9."))
    state.load(model, model.load_weights, [("gate.weight", GATE)], lambda n: n)
    state.check(model, {"layers.9.norm.weight": torch.ones(8)}, lambda n: n)
    with pytest.raises(EngineDtypeError, match=r"layers.9.norm.weight: vLLM's Toy holds no tensor"):
        held_with(kept(*names))


@pytest.mark.parametrize("engine_dtype", [bf16, torch.float16])
def test_a_kept_norm_casts_back_to_the_dtype_the_engine_runs_in(engine_dtype: torch.dtype) -> None:
    """Training's bulk was bf16; an engine serving in fp16 gets fp16 back from the kept norm
    (cast back to the record's bf16 it would meet fp16 kernels: ``BFloat16 != Half``)."""
    model, _ = held_with(
        kept("norm.weight", "norm.bias", casts=(NORM_CAST,)), engine_dtype=engine_dtype
    )
    model.norm.to(dtype=fp32)
    assert model.norm(torch.randn(3, 8).to(engine_dtype)).dtype == engine_dtype
