"""Parity of a plan-wrapped model against an unsharded reference that computes as FSDP does.

:func:`verify_parity` wraps a model with its :class:`~fsdp_precision.PrecisionPlan` and runs one
forward, backward and AdamW step on it and on an unsharded copy, the *reference*, that emulates
exactly what FSDP does to numerics:

* each parameter is cast to its planned compute dtype (what the all-gather delivers), while an
  fp32 (storage-dtype) master copy is what the optimizer updates;
* each unit's floating inputs are cast to the unit's ``param_dtype`` (``cast_forward_inputs``) and
  its outputs to ``output_dtype``, as FSDP's pre- and post-forward hooks do;
* each unit's grad-requiring inputs pass through an identity autograd node, as FSDP's
  ``RegisterPostBackwardFunction`` does, so gradients meeting from several uses sum in the same
  order;
* each gradient goes through the unit's ``reduce_dtype`` and lands in its parameter's storage
  dtype, as FSDP's reduce-scatter does.

Inputs must be identical on every rank. Then the all-gather is exact, so outputs and losses are
bitwise equal on any number of ranks, and FSDP's averaged gradient is the reference gradient
averaged over N copies of itself: bitwise on 1 and 2 ranks (``(g + g) / 2 == g``), within
rounding of the reduction on other counts (``(g + g + g) / 3`` can round). There the reference
optimizer steps on the gradients FSDP produced, so parameters still compare bitwise and the
gradients are checked against a tolerance, :func:`gradient_tolerance`.

Everything observed (the dtype each parameter was all-gathered in, every difference) is observed
on every rank and combined across ranks (the maximum), so a report holds for all of them.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from fsdp_precision._dtypes import dtype_name
from fsdp_precision._plan import PlannedParam, PrecisionPlan

__all__ = [
    "Comparison",
    "ParamParity",
    "ParityReport",
    "Reference",
    "compare",
    "gradient_tolerance",
    "loss_of",
    "output_of",
    "verify_parity",
]

#: Gradients are bitwise on these world sizes (with identical inputs on every rank).
BITWISE_WORLD_SIZES = (1, 2)


# --------------------------------------------------------------------------- comparisons


@dataclass(frozen=True)
class Comparison:
    """One tensor against its reference.

    Attributes:
        bitwise: Same dtype, shape and bits (``torch.equal``).
        max_abs_diff: ``max |got - expected|`` in float64 (``inf`` for a shape or NaN mismatch).
        scale: ``max |expected|``, the scale a tolerance is relative to.
    """

    bitwise: bool
    max_abs_diff: float
    scale: float

    def within(self, rtol: float | None) -> bool:
        """Bitwise, or (when ``rtol`` is given) ``max_abs_diff <= rtol * scale``."""
        if self.bitwise:
            return True
        return rtol is not None and self.max_abs_diff <= rtol * self.scale

    def describe(self) -> str:
        return "bitwise" if self.bitwise else f"{self.max_abs_diff:.3g}"


_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if torch.equal(a, b):
        return True
    if not a.is_floating_point():
        return False
    as_int = _SAME_SIZE_INT[a.element_size()]  # NaNs with the same bits are the same bits
    return torch.equal(a.contiguous().view(as_int), b.contiguous().view(as_int))


def compare(got: torch.Tensor, expected: torch.Tensor) -> Comparison:
    """Compare two plain tensors: same dtype, shape and bits; the max absolute difference."""
    finite = expected.detach()[torch.isfinite(expected.detach())] if expected.numel() else None
    scale = float(finite.double().abs().max()) if finite is not None and finite.numel() else 0.0
    if got.shape != expected.shape:
        return Comparison(False, math.inf, scale)
    same = _same_bits(got.detach(), expected.detach())
    if same or not got.numel():
        return Comparison(same, 0.0, scale)
    diff = float((got.detach().double() - expected.detach().double()).abs().max())
    return Comparison(False, diff if not math.isnan(diff) else math.inf, scale)


def gradient_tolerance(world_size: int, reduce_dtype: torch.dtype) -> float | None:
    """Relative tolerance of a reduced gradient: ``None`` (bitwise) on 1 and 2 ranks.

    On N ranks FSDP sums N copies of the same gradient (in ``reduce_dtype``) and divides by N;
    each of the N - 1 additions and the division rounds at most half an ulp, so
    ``max |got - expected| <= N * eps(reduce_dtype) * max |expected|`` bounds it.
    """
    if world_size in BITWISE_WORLD_SIZES:
        return None
    return world_size * torch.finfo(reduce_dtype).eps


# --------------------------------------------------------------------------- loss and outputs


def output_of(out: Any) -> torch.Tensor:
    """The tensor a model's output is judged by: ``logits``/``sample``, else the first tensor."""
    if isinstance(out, torch.Tensor):
        return out
    for name in ("logits", "sample", "last_hidden_state"):
        value = getattr(out, name, None)
        if isinstance(value, torch.Tensor):
            return value
    leaves, _ = tree_flatten(out)
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point():
            return leaf
    raise ValueError(f"the model returned no floating tensor ({type(out).__name__})")


def loss_of(out: Any) -> torch.Tensor:
    """``out.loss`` when the model computed one, else ``output_of(out).float().pow(2).mean()``."""
    loss = getattr(out, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    return output_of(out).float().pow(2).mean()


# --------------------------------------------------------------------------- the reference


def _cast_floating(dtype: torch.dtype | None) -> Callable[[Any], Any]:
    def cast(x: Any) -> Any:  # FSDP's _cast_fp_tensor
        if dtype is not None and isinstance(x, torch.Tensor) and x.is_floating_point():
            return x.to(dtype) if x.dtype != dtype else x
        return x

    return cast


class _Identity(torch.autograd.Function):
    """FSDP routes each unit's grad-requiring inputs through an identity autograd node
    (``RegisterPostBackwardFunction``); the reference does the same so that gradients meeting
    from several uses are summed in the same order."""

    @staticmethod
    def forward(ctx: Any, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return inputs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return grads


def _pre_forward(cast_to: torch.dtype | None, identity: bool) -> Callable[..., Any]:
    cast = _cast_floating(cast_to)

    def hook(module: nn.Module, args: Any, kwargs: Any) -> Any:
        args, kwargs = tree_map(cast, args), tree_map(cast, kwargs)
        if not identity or not torch.is_grad_enabled():
            return args, kwargs
        flat, spec = tree_flatten((args, kwargs))
        idx = [i for i, x in enumerate(flat) if isinstance(x, torch.Tensor) and x.requires_grad]
        if idx:
            outs = _Identity.apply(*(flat[i] for i in idx))  # type: ignore[no-untyped-call]
            for i, out in zip(idx, outs, strict=True):
                flat[i] = out
        return tree_unflatten(flat, spec)

    return hook


def _post_forward(output_dtype: torch.dtype) -> Callable[..., Any]:
    cast = _cast_floating(output_dtype)

    def hook(module: nn.Module, args: Any, output: Any) -> Any:
        return tree_map(cast, output)

    return hook


def _planned(plan: PrecisionPlan) -> dict[str, PlannedParam]:
    """Every FQN (aliases included) -> its planned parameter."""
    out: dict[str, PlannedParam] = {}
    for unit in plan.units:
        for p in unit.params:
            for fqn in (p.fqn, *p.aliases):
                out[fqn] = p
    return out


class Reference:
    """An unsharded copy of ``plan.model`` that computes as the plan's FSDP units will.

    Build it *before* ``plan.apply()``. ``module`` computes with each parameter in its planned
    compute dtype; ``masters`` holds the storage-dtype copies the optimizer updates, keyed by
    FQN (the first alias of a tied parameter).
    """

    def __init__(self, plan: PrecisionPlan) -> None:
        model = plan.model
        self.plan = plan
        self.module: nn.Module = copy.deepcopy(model)
        planned = _planned(plan)
        self.masters: dict[str, nn.Parameter] = {}
        with torch.no_grad():
            for fqn, param in self.module.named_parameters():  # one name per tied parameter
                self.masters[fqn] = nn.Parameter(
                    param.detach().clone(), requires_grad=param.requires_grad
                )
                compute = planned[fqn].compute
                if param.dtype != compute:
                    param.data = param.data.to(compute)
        names = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
        for unit in plan.units:
            policy = unit.policy
            cast = policy.param_dtype if policy.cast_forward_inputs else None
            for module in unit.modules:
                ref = self.module.get_submodule(names[id(module)])
                ref.register_forward_pre_hook(
                    _pre_forward(cast, identity=bool(unit.params)), with_kwargs=True
                )
                if policy.output_dtype is not None:
                    ref.register_forward_hook(_post_forward(policy.output_dtype))

    def master_grads(self) -> dict[str, torch.Tensor | None]:
        """Each compute-dtype gradient through its reduce dtype into its storage dtype."""
        planned = _planned(self.plan)
        grads: dict[str, torch.Tensor | None] = {}
        for fqn, param in self.module.named_parameters():
            p = planned[fqn]
            if param.grad is None or p.reduce is None:
                grads[fqn] = None
                continue
            grads[fqn] = param.grad.to(p.reduce).to(p.storage)
        return grads


# --------------------------------------------------------------------------- observing


@dataclass
class _Gathered:
    dtype: torch.dtype
    sharded: bool


@contextmanager
def _observe_gathers(plan: PrecisionPlan) -> Iterator[dict[str, _Gathered]]:
    """Per unit, a forward pre-hook registered after FSDP's (which is prepended): it reads every
    parameter of the unit right after the unit's all-gather, in the dtype FSDP delivered."""
    model = plan.model
    names = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
    seen: dict[str, _Gathered] = {}

    def hook_for(prefix: str, params: Sequence[PlannedParam]) -> Callable[..., None]:
        from torch.distributed.tensor import DTensor

        mine = [p for p in params if not prefix or p.fqn.startswith(prefix + ".")]

        def hook(module: nn.Module, args: Any) -> None:
            for p in mine:
                if p.fqn not in seen:
                    tensor = model.get_parameter(p.fqn)
                    seen[p.fqn] = _Gathered(tensor.dtype, isinstance(tensor, DTensor))

        return hook

    handles = [
        module.register_forward_pre_hook(hook_for(names[id(module)], unit.params))
        for unit in plan.units
        for module in unit.modules
    ]
    try:
        yield seen
    finally:
        for handle in handles:
            handle.remove()


# --------------------------------------------------------------------------- the report


@dataclass(frozen=True)
class ParamParity:
    """One parameter's results.

    Attributes:
        fqn: Root-relative FQN (the first alias of a tied parameter).
        aliases: Other FQNs of the same parameter.
        unit: The FSDP unit that manages it.
        storage: Storage dtype (the sharded parameter's dtype).
        compute: Planned compute dtype.
        gathered: Dtype observed after the unit's all-gather (``None``: the unit never ran).
        rule: What decided the compute dtype (``"default"``: the unit's ``param_dtype``).
        grad: Gradient against the reference (``None``: no gradient on either side).
        param: Parameter after the optimizer step against the reference's master copy.
        grad_rtol: Tolerance the gradient was held to (``None``: bitwise).
        gathered_sharded: Still a DTensor shard right after its unit's all-gather.
    """

    fqn: str
    aliases: tuple[str, ...]
    unit: str
    storage: torch.dtype
    compute: torch.dtype
    gathered: torch.dtype | None
    rule: str
    grad: Comparison | None
    param: Comparison
    grad_rtol: float | None = None
    gathered_sharded: bool = False

    def problems(self) -> list[str]:
        """What is wrong with this parameter (empty when nothing is)."""
        out = []
        if self.gathered is not None and self.gathered != self.compute:
            out.append(
                f"all-gathered in {dtype_name(self.gathered)}, planned {dtype_name(self.compute)}"
            )
        if self.gathered_sharded:
            out.append("still sharded after its unit's all-gather")
        if self.grad is not None and not self.grad.within(self.grad_rtol):
            out.append(f"gradient differs (max |diff| {self.grad.max_abs_diff:.3g})")
        if not self.param.bitwise:
            diff = self.param.max_abs_diff
            out.append(f"parameter after the step differs (max |diff| {diff:.3g})")
        return out


@dataclass(frozen=True)
class ParityReport:
    """What :func:`verify_parity` found, identical on every rank.

    Attributes:
        model: Class name of the model.
        world_size: Ranks the model was sharded over.
        rules: ``PrecisionRules.describe()`` of the plan.
        units: Number of FSDP units (``fully_shard`` calls with parameters).
        loss: The FSDP model's loss (rank 0's).
        reference_loss: The reference's loss.
        loss_match: Losses bitwise equal on every rank.
        output_match: Outputs (logits) bitwise equal on every rank.
        params: One entry per parameter, in ``named_parameters()`` order.
        optimizer: The optimizer step taken, e.g. ``"AdamW(lr=0.001)"``.
        grads_bitwise_expected: Whether the world size allows bitwise gradients.
        notes: Remarks that are not failures (a gradient on one side only is both).
    """

    model: str
    world_size: int
    rules: str
    units: int
    loss: float
    reference_loss: float
    loss_match: bool
    output_match: bool
    params: list[ParamParity]
    optimizer: str
    grads_bitwise_expected: bool
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Everything matched (within the stated tolerance where N is not 1 or 2)."""
        return self.loss_match and self.output_match and not any(p.problems() for p in self.params)

    def problems(self) -> list[str]:
        """One line per problem found."""
        out = []
        if not self.loss_match:
            out.append(f"loss {self.loss!r} != reference {self.reference_loss!r}")
        if not self.output_match:
            out.append("model output differs from the reference's")
        for p in self.params:
            out.extend(f"{p.fqn}: {problem}" for problem in p.problems())
        return out

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""

        def cmp(c: Comparison | None) -> dict[str, Any] | None:
            if c is None:
                return None
            diff = c.max_abs_diff if math.isfinite(c.max_abs_diff) else None
            return {"bitwise": c.bitwise, "max_abs_diff": diff, "scale": c.scale}

        return {
            "model": self.model,
            "world_size": self.world_size,
            "rules": self.rules,
            "units": self.units,
            "optimizer": self.optimizer,
            "grads_bitwise_expected": self.grads_bitwise_expected,
            "loss": self.loss,
            "reference_loss": self.reference_loss,
            "loss_bitwise": self.loss_match,
            "output_bitwise": self.output_match,
            "ok": self.ok,
            "problems": self.problems(),
            "notes": list(self.notes),
            "params": [
                {
                    "fqn": p.fqn,
                    "aliases": list(p.aliases),
                    "unit": p.unit,
                    "storage": dtype_name(p.storage),
                    "compute": dtype_name(p.compute),
                    "gathered": dtype_name(p.gathered) if p.gathered is not None else None,
                    "rule": p.rule,
                    "grad": cmp(p.grad),
                    "grad_rtol": p.grad_rtol,
                    "param": cmp(p.param),
                    "ok": not p.problems(),
                }
                for p in self.params
            ],
        }


# --------------------------------------------------------------------------- the check


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _max_over_ranks(values: list[float]) -> list[float]:
    if not dist.is_initialized() or dist.get_world_size() == 1 or not values:
        return values
    tensor = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.tolist()


def verify_parity(
    plan: PrecisionPlan,
    inputs: Mapping[str, Any],
    *,
    lr: float = 1e-3,
    seed: int = 0,
    context: Callable[[], AbstractContextManager[Any]] | None = None,
    loss_fn: Callable[[Any], torch.Tensor] = loss_of,
    **fully_shard_kwargs: Any,
) -> ParityReport:
    """Wrap ``plan.model`` with ``plan`` and check it against the unsharded reference.

    One forward (``model(**inputs)``), backward of ``loss_fn(output)`` and ``AdamW(lr)`` step on
    both; compared: output and loss (bitwise), every gradient (bitwise on 1 and 2 ranks, else
    within :func:`gradient_tolerance`), every parameter after the step (bitwise), and the dtype
    each parameter was all-gathered in (its planned compute dtype). ``inputs`` must be identical
    on every rank; the RNG is seeded with ``seed`` before each forward (dropout masks agree).
    ``context`` (e.g. ``lambda: torch.autocast("cpu")``) wraps both forwards. Every rank must
    call this (it runs collectives); every rank returns the same report.

    Raises ``ValueError`` when the model is already wrapped.
    """
    from torch.distributed.tensor import DTensor

    model = plan.model
    if any(isinstance(p, DTensor) for p in model.parameters()):
        raise ValueError(
            "verify_parity needs the unwrapped model: build the reference before fully_shard"
        )
    world = dist.get_world_size() if dist.is_initialized() else 1
    make_context = context or nullcontext
    name = type(model).__name__  # fully_shard changes the class to FSDP<name>
    reference = Reference(plan)
    plan.apply(**fully_shard_kwargs)
    planned = _planned(plan)
    unit_of = {p.fqn: u.name for u in plan.units for p in u.params}

    with ExitStack() as stack:
        seen = stack.enter_context(_observe_gathers(plan))
        stack.enter_context(make_context())
        torch.manual_seed(seed)
        out = model(**inputs)
    with make_context():
        torch.manual_seed(seed)
        ref_out = reference.module(**inputs)
    output, ref_output = output_of(out), output_of(ref_out)
    output_match = output.dtype == ref_output.dtype and torch.equal(output, ref_output)
    loss, ref_loss = loss_fn(out), loss_fn(ref_out)
    loss_match = loss.dtype == ref_loss.dtype and torch.equal(loss, ref_loss)
    loss.backward()  # type: ignore[no-untyped-call]
    ref_loss.backward()  # type: ignore[no-untyped-call]

    params = dict(model.named_parameters())
    ref_grads = reference.master_grads()
    grads: dict[str, Comparison | None] = {}
    notes: list[str] = []
    for fqn, param in params.items():
        expected = ref_grads[fqn]
        if param.grad is None and expected is None:
            grads[fqn] = None
            continue
        if param.grad is None or expected is None:
            side = "FSDP" if param.grad is None else "the reference"
            grads[fqn] = Comparison(False, math.inf, 0.0)
            notes.append(f"{fqn}: no gradient on {side}")
            continue
        got = _full(param.grad)
        grads[fqn] = compare(got, expected)
        master = reference.masters[fqn]
        # On 1 or 2 ranks the reference steps on its own gradient (end to end); elsewhere on the
        # gradient FSDP reduced, so that the optimizer step itself still compares bitwise.
        master.grad = expected if world in BITWISE_WORLD_SIZES else got.detach().clone()

    optimizer = torch.optim.AdamW([p for p in params.values() if p.grad is not None], lr=lr)
    ref_optimizer = torch.optim.AdamW(
        [m for m in reference.masters.values() if m.grad is not None], lr=lr
    )
    optimizer.step()
    ref_optimizer.step()
    after = {
        fqn: compare(_full(p.detach()), reference.masters[fqn].detach())
        for fqn, p in params.items()
    }
    not_finite = [f for f, m in reference.masters.items() if not bool(m.detach().isfinite().all())]
    if not_finite:
        fp16 = any(reference.masters[f].dtype == torch.float16 for f in not_finite)
        notes.append(
            f"{len(not_finite)} parameters are not finite after the reference's step too "
            f"(e.g. {not_finite[0]}); they were compared bit for bit"
            + ("; AdamW's eps (1e-8) is 0 in float16 storage" if fp16 else "")
        )

    # Combine across ranks: the worst of every rank.
    order = list(params)
    flat: list[float] = [0.0 if loss_match else 1.0, 0.0 if output_match else 1.0]
    for fqn in order:
        g, a = grads[fqn], after[fqn]
        flat += [0.0 if g is None or g.bitwise else 1.0, g.max_abs_diff if g else 0.0]
        flat += [0.0 if a.bitwise else 1.0, a.max_abs_diff]
        gathered = seen.get(fqn)
        flat += [1.0 if gathered is not None and gathered.sharded else 0.0]
    flat = _max_over_ranks(flat)
    loss_match, output_match = flat[0] == 0.0, flat[1] == 0.0
    results = []
    for i, fqn in enumerate(order):
        g_bad, g_diff, a_bad, a_diff, sharded = flat[2 + 5 * i : 7 + 5 * i]
        p = planned[fqn]
        g = grads[fqn]
        gathered = seen.get(fqn)
        results.append(
            ParamParity(
                fqn=fqn,
                aliases=p.aliases,
                unit=unit_of.get(p.fqn, "?"),
                storage=p.storage,
                compute=p.compute,
                gathered=gathered.dtype if gathered is not None else None,
                rule=p.rule,
                grad=None if g is None else Comparison(g_bad == 0.0, g_diff, g.scale),
                param=Comparison(a_bad == 0.0, a_diff, after[fqn].scale),
                grad_rtol=gradient_tolerance(world, p.reduce) if p.reduce is not None else None,
                gathered_sharded=sharded != 0.0,
            )
        )
    return ParityReport(
        model=name,
        world_size=world,
        rules=plan.rules.describe(),
        units=len([u for u in plan.units if u.params]),
        loss=float(loss.detach()),
        reference_loss=float(ref_loss.detach()),
        loss_match=loss_match,
        output_match=output_match,
        params=results,
        optimizer=f"AdamW(lr={lr:g})",
        grads_bitwise_expected=world in BITWISE_WORLD_SIZES,
        notes=notes,
    )
