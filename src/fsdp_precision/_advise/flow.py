"""Where each parameter's values flow in a traced forward: the facts the precision advisor reads.

A torch-function mode follows every floating tensor of one forward (on the meta device at full
size, or on real inputs) and keeps, per tensor, the parameters it was computed from and how:

- a :class:`Path` per parameter: the ops since the parameter entered (``hops``), how many of them
  were products with a weight (``matmuls``: ``linear``, ``matmul``, ``bmm``, ``embedding``, ...;
  a product of two activations, such as attention's ``q @ k``, does not count), the
  notable ops on the way (``via``), and whether activations were mixed in elementwise
  (``mixed``). A path dies at its second matrix product or after :data:`MAX_HOPS` ops: a
  parameter then no longer decides anything by itself (the residual stream carries every earlier
  weight, and nothing here is about them);
- three facts about the tensor itself: it depends on the model's inputs (``activation``), it was
  normalised (``normalized``: a norm op, or a product with an ``rsqrt``), and it holds the result
  of a softmax or sigmoid since the last matrix product (``scores``).

At each op it records a :class:`Finding` where a parameter's path meets:

- a selection (``topk``, ``argmax``, ``sort``, ...) of scores computed from it by at most one
  matrix product: a **router** (expert selection);
- an exponential or logarithm (``exp``, ``softplus``, ``log``, ``softmax`` as logits, ...) with no
  matrix product on the way: a **log-space** parameter (``A_log``, ``dt_bias``, time decays);
- a product with activations, with no matrix product on the way: a **gain** (``logit_scale``,
  Mamba's ``D``, adaLN modulation tables) or, for a 1-D parameter that scales normalised
  activations unmixed, a **norm** weight (norm ops' own weights and biases too);
- a matrix product with sinusoidal features (``sin``/``cos`` of a timestep, and what weights
  compute from them before they meet the token activations): a **sinusoidal** weight (a
  timestep embedding's MLP).

Nothing here reads a name: the names come in only when the advice is worded. Pure public torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree
from torch.utils.weak import WeakIdKeyDictionary

from fsdp_precision._base.watch import RunningModules, attribute_read

__all__ = ["KINDS", "MAX_HOPS", "Finding", "Flow", "Kind", "Path"]

#: What a finding says a parameter is, strongest first.
Kind = Literal["router", "log_space", "gain", "sinusoidal", "norm"]
KINDS: tuple[Kind, ...] = ("router", "log_space", "gain", "sinusoidal", "norm")

#: Ops after which a parameter's path is dropped.
MAX_HOPS = 32

_MATMUL = frozenset(
    {"linear", "matmul", "__matmul__", "__rmatmul__", "mm", "bmm", "addmm", "baddbmm",
     "addbmm", "addmv", "mv", "einsum", "tensordot", "bilinear", "embedding", "embedding_bag",
     "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
     "_grouped_mm", "grouped_mm", "scaled_dot_product_attention", "flex_attention"}
)  # fmt: skip
_NORM = frozenset(
    {"layer_norm", "rms_norm", "group_norm", "batch_norm", "instance_norm", "normalize"}
)
_INVERSE_SCALE = frozenset({"rsqrt", "rsqrt_"})
_SINUSOID = frozenset({"sin", "cos", "sin_", "cos_"})
_SCORE = frozenset({"softmax", "_softmax", "sigmoid", "sigmoid_", "log_softmax", "gumbel_softmax"})
#: (``max`` with a dim returns indices too, but models call it to stabilise a softmax.)
_SELECT = frozenset({"topk", "argmax", "argmin", "sort", "argsort", "kthvalue", "msort"})
_EXP = frozenset(
    {"exp", "exp_", "exp2", "expm1", "softplus", "log", "log_", "log1p", "log2", "log10",
     "logsumexp", "logaddexp", "softmax", "_softmax", "log_softmax", "logsigmoid"}
)  # fmt: skip
_SCALE = frozenset(
    {"mul", "mul_", "__mul__", "__rmul__", "__imul__", "div", "div_", "__truediv__",
     "__rtruediv__", "__itruediv__", "addcmul", "addcmul_"}
)  # fmt: skip
_ADD = frozenset(
    {"add", "add_", "__add__", "__radd__", "__iadd__", "sub", "sub_", "__sub__", "__rsub__",
     "__isub__"}
)  # fmt: skip
#: Ops worth naming in a reason (the rest reshape, cast or copy).
_NOTABLE = _MATMUL | _NORM | _SCORE | _EXP | _SELECT | _INVERSE_SCALE


@dataclass(frozen=True)
class Path:
    """How a tensor was computed from one parameter.

    Attributes:
        hops: Ops since the parameter entered.
        matmuls: Matrix products among them (0 or 1; a second drops the path).
        via: The notable ops on the way, in order (at most 6 kept).
        mixed: Activations were mixed in elementwise (an adaLN table plus a timestep embedding).
        pure: Still the parameter alone (cast, reshaped, scaled by constants).
        direct: The matrix product took the parameter itself (a router's weight), not a tensor
            computed from it (a norm weight before the router's ``linear``).
        scaled: It multiplied activations already: from there on it is part of them (a norm
            weight, downstream of its norm), not a gain or an exponent of its own.
    """

    hops: int = 0
    matmuls: int = 0
    via: tuple[str, ...] = ()
    mixed: bool = False
    pure: bool = True
    direct: bool = False
    scaled: bool = False

    @property
    def decides(self) -> bool:
        """Whether a selection over this path's tensor is decided by the parameter: it entered
        the scores by the matrix product that made them, or after it (a bias on the scores)."""
        return self.matmuls == 0 or self.direct


@dataclass
class _Taint:
    paths: dict[int, Path] = field(default_factory=dict)  # id(parameter) -> path
    activation: bool = False
    normalized: bool = False
    scores: bool = False
    inverse_scale: bool = False
    sinusoidal: bool = False


@dataclass(frozen=True)
class Finding:
    """One parameter meeting one op in a way that makes its precision matter.

    Attributes:
        param: The parameter's FQN (its first name).
        kind: What it is (:data:`KINDS`).
        via: The notable ops from the parameter to the deciding op, that op last.
        where: FQN of the innermost module running at the deciding op (``"<root>"``).
    """

    param: str
    kind: Kind
    via: tuple[str, ...]
    where: str


def _name(func: Callable[..., Any]) -> str:
    return str(getattr(func, "__name__", "") or "")


class Flow(TorchFunctionMode):
    """While entered, follows ``model``'s parameters through every torch function; the
    model's inputs must be marked with :meth:`mark_inputs` first. :attr:`findings` holds the
    first finding per (parameter, kind); :attr:`touched` every parameter an op read."""

    def __init__(self, model: nn.Module, running: RunningModules) -> None:
        super().__init__()
        named = list(model.named_parameters())
        self.params: dict[int, str] = {id(p): n for n, p in named}
        self.dims: dict[int, int] = {id(p): p.dim() for _, p in named}
        self.running = running
        self.taints: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.findings: dict[tuple[str, Kind], Finding] = {}
        self.touched: set[str] = set()

    def mark_inputs(self, inputs: Any) -> None:
        """The model's inputs: everything computed from them is an activation."""
        for leaf in pytree.tree_leaves(inputs):
            if isinstance(leaf, torch.Tensor):
                self.taints[leaf] = _Taint(activation=True)

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if attribute_read(func) is not None:
            return out
        tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if not tensors:
            return out
        name = _name(func)
        inputs = [self._taint_of(t) for t in tensors]
        if not any(t.paths or t.activation for t in inputs):
            return out
        self._find(name, tensors, inputs, out)
        taint = self._through(name, inputs)
        # Integer results (indices, token ids) carry only whether they depend on the inputs: the
        # experts a router picked are not computed from the router's weight.
        counted = _Taint(activation=taint.activation)
        for leaf in pytree.tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                self.taints[leaf] = taint if leaf.is_floating_point() else counted
        return out

    # ------------------------------------------------------------------ taints

    def _taint_of(self, tensor: torch.Tensor) -> _Taint:
        known = self.taints.get(tensor)  # type: ignore[no-untyped-call]
        if known is not None:
            return known  # type: ignore[no-any-return]
        fqn = self.params.get(id(tensor))
        if fqn is None:
            return _Taint()
        self.touched.add(fqn)
        return _Taint(paths={id(tensor): Path()})

    def _through(self, name: str, inputs: list[_Taint]) -> _Taint:
        """The taint of an op's outputs, from its inputs'."""
        # A product with a weight (a tensor made of parameters alone) projects; a product of
        # two activations (attention's q @ k, an indexer weighting its scores) only mixes them.
        matmul = name in _MATMUL and any(t.paths and not t.activation for t in inputs)
        activation = any(t.activation for t in inputs)
        notable = (name,) if name in _NOTABLE else ()
        paths: dict[int, Path] = {}
        for taint in inputs:
            others_active = any(o.activation for o in inputs if o is not taint)
            for key, path in taint.paths.items():
                step = Path(
                    hops=path.hops + 1,
                    matmuls=path.matmuls + matmul,
                    via=(path.via + notable)[-6:],
                    mixed=path.mixed or (others_active and not matmul),
                    pure=path.pure and not others_active and not matmul,
                    direct=path.direct or (matmul and path.pure),
                    scaled=path.scaled or (name in _SCALE and others_active),
                )
                if step.matmuls > 1 or step.hops > MAX_HOPS:
                    continue
                known = paths.get(key)
                if known is None or step.hops < known.hops:
                    paths[key] = step
        normalized = name in _NORM or (
            not matmul
            and any(t.normalized for t in inputs)
            and not (name in _ADD and sum(t.activation for t in inputs) > 1)
        )
        if name in _SCALE and any(t.inverse_scale for t in inputs):
            normalized = True
        return _Taint(
            paths=paths,
            activation=activation,
            normalized=normalized,
            scores=name in _SCORE or (not matmul and any(t.scores for t in inputs)),
            inverse_scale=name in _INVERSE_SCALE and activation,
            # sin/cos features, and what is computed from them alone (weights included)
            sinusoidal=name in _SINUSOID
            or (
                any(t.sinusoidal for t in inputs)
                and all(t.sinusoidal or not t.activation for t in inputs)
            ),
        )

    # ------------------------------------------------------------------ findings

    def _find(
        self,
        name: str,
        tensors: list[torch.Tensor],
        inputs: list[_Taint],
        out: Any,
    ) -> None:
        if name in _SELECT:
            head = inputs[0]
            if head.activation:
                for key, path in head.paths.items():
                    if path.decides:
                        self._record(key, "router", path, name)
            return
        if name in _EXP:
            for taint in inputs:
                for key, path in taint.paths.items():
                    if path.matmuls == 0 and not path.scaled:
                        self._record(key, "log_space", path, name)
        if name in _MATMUL and any(t.sinusoidal for t in inputs):
            for taint in inputs:
                for key, path in taint.paths.items():
                    if path.pure and not taint.sinusoidal:
                        self._record(key, "sinusoidal", path, name)
        if name in _NORM:
            for tensor, taint in zip(tensors[1:], inputs[1:], strict=True):
                for key, path in taint.paths.items():
                    if path.pure and tensor.dim() <= 1:
                        self._record(key, "norm", path, name)
        if name in _SCALE and isinstance(out, torch.Tensor):
            for i, taint in enumerate(inputs):
                others = [o for j, o in enumerate(inputs) if j != i and o.activation]
                # A gain is broadcast over what it scales: fewer values than the product.
                if not others or tensors[i].numel() >= out.numel():
                    continue
                for key, path in taint.paths.items():
                    if path.matmuls or path.scaled or any(key in o.paths for o in others):
                        continue
                    one_d = self.dims.get(key, 2) <= 1
                    weak = path.pure and one_d and any(o.normalized for o in others)
                    self._record(key, "norm" if weak else "gain", path, name)

    def _record(self, key: int, kind: Kind, path: Path, op: str) -> None:
        fqn = self.params.get(key)
        if fqn is None or (fqn, kind) in self.findings:
            return
        via = path.via if path.via and path.via[-1] == op else (*path.via, op)
        self.findings[(fqn, kind)] = Finding(fqn, kind, via, self.running.innermost)
