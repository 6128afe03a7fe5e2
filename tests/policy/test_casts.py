"""Boundary casts of kept modules: a kept module computes in its dtype without model surgery.

A model that does not cast for itself (a router calling ``F.linear(x, self.weight)``, a norm
returning ``weight * x``) fails with an fp32 weight among bf16 activations; the boundary cast
(``Glob(..., boundary=...)``, or ``module_casts`` on the per-call policy) casts its inputs and,
for norms and scales, its outputs back, as a nested FSDP unit's ``cast_forward_inputs`` /
``output_dtype`` would. Every case has its negative control: the same model without the cast.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

import fsdp_precision as fp
from fsdp_precision import ModuleCast, ParamDtypeMapError, ParamDtypeMixedPrecisionPolicy
from fsdp_precision._policy.casts import cast_for, installed_cast

from tests.support.models import bf16, fp16, fp32

pytestmark = pytest.mark.usefixtures("world1")


class Router(nn.Module):
    """Computes in whatever its inputs are: no cast of its own (Qwen3-MoE's TopKRouter)."""

    def __init__(self, dim: int, experts: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(experts, dim) / dim**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight).softmax(-1)


class Scale(nn.Module):
    """``weight * x``: an fp32 weight turns bf16 activations fp32 (DeepSeek-V3's RMSNorm)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(1 + torch.randn(dim) / 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * x


class Layer(nn.Module):
    def __init__(self, dim: int = 16, experts: int = 4) -> None:
        super().__init__()
        self.norm = Scale(dim)
        self.router = Router(dim, experts)
        self.up = nn.Linear(dim, dim * experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        weights = self.router(h)  # fp32 when the router is kept: the model casts it back
        experts = self.up(h).unflatten(-1, (weights.shape[-1], -1))
        return x + (experts * weights.to(experts.dtype).unsqueeze(-1)).sum(-2)


class Model(nn.Module):
    def __init__(self, depth: int = 2, dim: int = 16) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Layer(dim) for _ in range(depth))
        self.head = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def model() -> Model:
    torch.manual_seed(0)
    return Model()


def x() -> torch.Tensor:
    return torch.randn(3, 16, generator=torch.Generator().manual_seed(1))


def run(m: nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    loss = m(x()).float().square().mean()
    loss.backward()
    grads = {n: p.grad.full_tensor() for n, p in m.named_parameters() if p.grad is not None}
    return loss.detach(), grads


def rules(*globs: str, boundary: str = "auto") -> fp.PrecisionRules:
    return fp.PrecisionRules(
        rules=tuple(fp.Glob(g, boundary=boundary) for g in globs),  # type: ignore[arg-type]
        param_dtype=bf16,
        reduce_dtype=fp32,
    )


def wrap(m: Model, policy: MixedPrecisionPolicy) -> Model:
    for layer in m.layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(m, mp_policy=policy)
    return m


# ---------------------------------------------------------------------- what "auto" decides

AUTO = [
    # (kept dtype, activation dtype, params' dims, returns activations, outputs cast back)
    (fp32, bf16, (1,), False, True),  # a norm: its output goes to the next bf16 matmul
    (fp32, bf16, (2,), False, False),  # a router: fp32 logits for softmax and top-k
    (fp32, bf16, (2, 1), False, False),  # a router with a bias
    (fp32, bf16, (2,), True, True),  # Llama 4's router: returns the mixing weights
    (fp16, bf16, (2,), False, True),  # fp16 is not wider than bf16: back to bf16
    (bf16, fp32, (2,), False, True),  # kept narrower than the activations
    (fp32, fp16, (0, 1), False, True),  # scales and gains
]


@pytest.mark.parametrize(("kept", "activation", "dims", "returns", "back"), AUTO)
def test_auto_casts_inputs_and_decides_outputs(kept, activation, dims, returns, back) -> None:
    params = [torch.empty((2,) * d) for d in dims]
    cast = cast_for("auto", kept, params, activation, returns_activations=returns)
    assert cast == ModuleCast(kept, outputs=back)
    assert cast_for("none", kept, params, activation) is None
    assert cast_for("inputs", kept, params, activation) == ModuleCast(kept, outputs=False)
    assert cast_for("inputs_outputs", kept, params, activation) == ModuleCast(kept, outputs=True)


# ---------------------------------------------------------------------- model_policy, plans


@pytest.mark.parametrize(
    "globs",
    [("*router.weight",), ("*norm.weight",), ("*router.weight", "*norm.weight")],
    ids=["router", "norm", "both"],
)
def test_kept_modules_train_with_no_hook_of_the_users(globs: tuple[str, ...]) -> None:
    ours, nested, none = (model() for _ in range(3))
    policy = fp.model_policy(ours, rules(*globs))
    wrap(ours, policy)
    loss, grads = run(ours)
    cast = {n for n, m in ours.named_modules() if installed_cast(m) is not None}
    assert cast == {f"layers.{i}.{g[1:].rpartition('.')[0]}" for i in (0, 1) for g in globs}
    # Bitwise what nested units do with FSDP's own casts (public API only).
    plan = fp.compile_param_dtype_maps(nested, rules(*globs), [*nested.layers, nested])
    separate = fp.compile_param_dtype_maps(
        nested, rules(*globs), [*nested.layers, nested], layout="separate_units"
    )
    assert {u.name for u in separate.units if u.separate_unit} == set(plan.module_casts)
    separate.apply()
    nested_loss, nested_grads = run(nested)
    assert torch.equal(loss, nested_loss)
    assert grads.keys() == nested_grads.keys()
    assert all(torch.equal(grads[n], nested_grads[n]) for n in grads)
    # Negative control: without boundary casts the model's own code meets the fp32 weights.
    wrap(none, fp.model_policy(none, rules(*globs, boundary="none")))
    with pytest.raises(RuntimeError, match="dtype|Float|BFloat16"):
        run(none)


def test_plans_compile_the_outermost_module_kept_whole() -> None:
    m = model()
    plan = fp.compile_param_dtype_maps(m, rules("*router.*", "layers.0.*"), [*m.layers, m])
    # layers.0, a unit, is kept whole: a unit of fp32 (FSDP casts its inputs; a matrix kept
    # wider returns fp32), no cast inside it; layers.1.router alone gets a boundary cast.
    assert plan.module_casts == {"layers.1.router": ModuleCast(fp32, outputs=False)}
    layer0 = plan.units[0].policy
    assert (layer0.param_dtype, layer0.output_dtype, layer0.cast_forward_inputs) == (
        fp32,
        None,
        True,
    )
    assert not plan.units[0].param_dtype_map
    assert "boundary cast at layers.1.router: inputs -> float32" in plan.explain()
    units = plan.to_dict()["units"]
    assert units[1]["module_casts"] == {
        "layers.1.router": {"inputs": "float32", "outputs_cast_back": False}
    }
    # A module holding parameters of two dtypes is not kept whole: no cast.
    plan = fp.compile_param_dtype_maps(m, rules("*router.weight", "*up.weight"), [m])
    assert set(plan.module_casts) == {f"layers.{i}.{k}" for i in (0, 1) for k in ("router",)}
    # Kept in the activations' dtype: nothing to cast.
    same = fp.PrecisionRules(rules=(fp.Glob("*router.weight", bf16),), param_dtype=bf16)
    assert fp.compile_param_dtype_maps(m, same, [m]).module_casts == {}


class Norms(nn.Module):
    """Two norms in a ModuleList (LongCat-Flash's input_layernorm): the list is never called."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.norms = nn.ModuleList(Scale(dim) for _ in range(2))
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norms[1](self.norms[0](x)))


def test_a_container_is_never_the_cast_module() -> None:
    torch.manual_seed(0)
    m = Norms()
    plan = fp.compile_param_dtype_maps(m, rules("norms.*"), [m])
    assert set(plan.module_casts) == {"norms.0", "norms.1"}
    plan.apply()
    m(x()).sum().backward()


def test_rules_that_disagree_on_a_module_are_refused() -> None:
    m = model()
    both = fp.PrecisionRules(
        rules=(fp.Glob("layers.0.*.weight"), fp.Glob("layers.0.*.bias", boundary="none")),
        param_dtype=bf16,
    )
    with pytest.raises(
        ParamDtypeMapError,
        match=r"module 'layers\.0' is kept whole, but the rules that claimed its parameters ask "
        r"for different boundaries: glob 'layers\.0\.\*\.weight' \(boundary 'auto'\), glob "
        r"'layers\.0\.\*\.bias' \(boundary 'none'\)",
    ):
        fp.compile_param_dtype_maps(m, both, [m])


def test_model_declarations_cast_nothing() -> None:
    """A model's own declaration keeps its forward as its library loads it: no cast, unless a
    user rule claims the module."""
    pytest.importorskip("transformers", reason="needs the hf extra (transformers)")
    from tests.support.hf_models import t5

    plan = fp.compile_param_dtype_maps(t5(), fp.PrecisionRules(param_dtype=fp16))  # declares wo
    assert plan.module_casts == {} and any(p.mapped for p in plan.params_by_fqn.values())
    user = fp.PrecisionRules(rules=(fp.Glob("*.wo.weight"),), param_dtype=fp16)
    plan = fp.compile_param_dtype_maps(t5(), user)
    assert plan.module_casts and all(k.endswith(".wo") for k in plan.module_casts)


# ---------------------------------------------------------------------- the per-call policy


def test_module_casts_on_the_per_call_policy() -> None:
    ours, bare = model(), model()
    for m, casts in ((ours, {"router": ModuleCast(fp32)}), (bare, {})):
        for layer in m.layers:
            policy = ParamDtypeMixedPrecisionPolicy(
                param_dtype=bf16,
                reduce_dtype=fp32,
                param_dtype_map={"router.weight": fp32},
                module_casts=casts,
            )
            fully_shard(layer, mp_policy=policy)
        fully_shard(m, mp_policy=MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32))
    run(ours)
    assert installed_cast(ours.layers[0].router) == ModuleCast(fp32)
    with pytest.raises(RuntimeError, match="same dtype"):  # negative control
        run(bare)


def test_a_cast_alone_takes_torchs_path_and_installs() -> None:
    m = model()
    policy = ParamDtypeMixedPrecisionPolicy(
        param_dtype=bf16, module_casts={"layers.0.norm": ModuleCast(fp32, outputs=True)}
    )
    fully_shard(m, mp_policy=policy)
    assert installed_cast(m.layers[0].norm) == ModuleCast(fp32, outputs=True)
    assert installed_cast(m.layers[1].norm) is None
    m(x())


def test_an_unknown_module_is_refused_before_anything_is_sharded() -> None:
    m = model()
    policy = ParamDtypeMixedPrecisionPolicy(
        param_dtype=bf16, module_casts={"layers.0.rooter": ModuleCast(fp32)}
    )
    with pytest.raises(
        ParamDtypeMapError, match=r"'layers\.0\.rooter'.*did you mean 'layers\.0\.router'"
    ):
        fully_shard(m, mp_policy=policy)
    assert not any(isinstance(p, DTensor) for p in m.parameters())
    assert installed_cast(m.layers[0].router) is None


BAD = [
    ({"router": torch.float32}, r"module_casts\['router'\] must be a ModuleCast"),
    ({"*.router": ModuleCast(fp32)}, r"exact module FQNs"),
    (["router"], r"module_casts must be a mapping"),
]


@pytest.mark.parametrize(("casts", "message"), BAD)
def test_bad_module_casts_name_the_problem(casts: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ParamDtypeMixedPrecisionPolicy(param_dtype=bf16, module_casts=casts)  # type: ignore[arg-type]


def test_bad_casts_and_boundaries_name_the_value() -> None:
    with pytest.raises(ValueError, match=r"ModuleCast.outputs must be True or False, got 'yes'"):
        ModuleCast(fp32, outputs="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"Glob\('\*'\)\.boundary is 'output'; use one of 'auto'"):
        fp.Glob("*", boundary="output")  # type: ignore[arg-type]


# ---------------------------------------------------------------------- hooks


def test_casts_survive_activation_checkpointing_and_reentry() -> None:
    from torch.utils.checkpoint import checkpoint

    ours, plain = model(), model()
    wrap(ours, fp.model_policy(ours, rules("*router.weight", "*norm.weight")))
    wrap(plain, fp.model_policy(plain, rules("*router.weight", "*norm.weight")))
    layer = ours.layers[0]
    original = layer.forward
    layer.forward = lambda h: checkpoint(original, h, use_reentrant=False)  # type: ignore[method-assign]
    loss, grads = run(ours)
    plain_loss, plain_grads = run(plain)
    assert torch.equal(loss, plain_loss)
    assert all(torch.equal(grads[n], plain_grads[n]) for n in grads)


def test_the_upcast_keeps_a_bf16_model_trainable() -> None:
    """A bf16 model (a bf16 checkpoint) with its routers and norms kept: upcast exactly, cast at
    their boundary, trained; no ``.float()`` of the user's."""
    m = model().to(bf16)
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    wrap(m, fp.model_policy(m, rules("*router.weight", "*norm.weight")))
    run(m)
    for name, param in m.named_parameters():
        kept = name.endswith(("router.weight", "norm.weight"))
        assert param.dtype == (fp32 if kept else bf16)
        assert torch.equal(param.full_tensor().to(bf16), before[name])  # exact


class AdaNorm(nn.Module):
    """LTX-Video's ``AdaLayerNormSingle``: it rounds the timestep features to the activations'
    dtype itself, before its embedder's first linear."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.embed = nn.Sequential(nn.Linear(8, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.linear = nn.Linear(dim, dim)

    def forward(self, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        features = torch.cat([t.sin(), t.cos()], dim=-1)
        return self.linear(F.silu(self.embed(features.to(dtype))))


class Timed(nn.Module):
    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.ada = AdaNorm(dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x[:, :4].float() * 100
        return self.proj(x) * (1 + self.ada(t, x.dtype))


def test_kept_modules_inside_a_cast_module_cast_their_inputs_too() -> None:
    torch.manual_seed(0)
    m = Timed()
    kept = rules("ada.*", boundary="inputs_outputs")
    plan = fp.compile_param_dtype_maps(m, kept, [m])
    assert plan.module_casts == {
        "ada": ModuleCast(fp32, outputs=True),  # the outermost casts back
        "ada.embed.0": ModuleCast(fp32),  # inside it: inputs only
        "ada.embed.2": ModuleCast(fp32),
        "ada.linear": ModuleCast(fp32),
    }
    fully_shard(m, mp_policy=fp.model_policy(m, kept))
    out = m(x())
    assert out.dtype == bf16
    out.float().square().mean().backward()
    # Negative control: the outermost cast alone, and the model's own rounding meets fp32.
    torch.manual_seed(0)
    bare = Timed()
    policy = ParamDtypeMixedPrecisionPolicy(
        param_dtype=bf16,
        reduce_dtype=fp32,
        param_dtype_map={n: fp32 for n, _ in bare.named_parameters() if n.startswith("ada.")},
        module_casts={"ada": ModuleCast(fp32, outputs=True)},
    )
    fully_shard(bare, mp_policy=policy)
    with pytest.raises(RuntimeError, match="same dtype"):
        bare(x())
