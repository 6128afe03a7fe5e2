"""Find the routers of a Hugging Face MoE model that replay can drive, or refuse it by name.

A router is a module whose class is named like one (``...Router``, ``...Gating``,
``...Gate``), knows its expert count and its top-k (``num_experts``/``top_k`` in 70 of
transformers' router classes; other spellings in :data:`ATTRIBUTES`) and sits in a decoder
layer (``...layers.<i>...``, ``i`` the absolute decoder index the engines key routes by).
Replay drives the router's own ``topk`` over its experts (:mod:`.replay`); routers whose
selection is not such a top-k are refused with the reason (:data:`REFUSED`). The table of every
transformers MoE family, screened, is ``docs/replay-families.md``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import torch.nn as nn

from fsdp_precision._base.errors import RoutingReplayError

__all__ = ["ATTRIBUTES", "REFUSED", "FoundRouter", "RouteShape", "find_routers", "router_class"]

#: Router classes whose selection replay cannot drive, and why.
REFUSED: dict[str, str] = {
    "DeepseekV4HashRouter": "it picks experts by a hash of the token id, not by a top-k",
    "PhimoeTopKRouter": "its sparsemixer picks experts by masked argmax, not by a top-k",
    "SwitchTransformersTop1Router": "it picks one expert by argmax, not by a top-k",
    "NllbMoeTop2Router": "it picks by argmax twice and drops its second expert at random",
    "DbrxRouter": "it returns logits only; its experts module selects, outside the router",
    "JetMoeTopKGating": (
        "each JetMoE decoder layer routes twice, its attention experts (JetMoeMoA) and its MLP "
        "experts (JetMoeMoE) each by a JetMoeTopKGating, and routes hold one row per layer"
    ),
    "Ernie4_5_VLMoeMoeTopKRouter": (
        "each decoder layer routes text tokens by its text_moe gate and image and video tokens "
        "by its vision_moe gate, each over a subset of the batch, and routes hold one row per "
        "token and layer for every router"
    ),
}

#: Router classes that name their expert count and top-k otherwise: (experts, top-k), dotted
#: attribute paths on the router module.
ATTRIBUTES: dict[str, tuple[str, str]] = {
    "Gemma4TextRouter": ("config.num_experts", "config.top_k_experts"),
    "DiffusionGemmaTextRouter": ("config.num_experts", "config.top_k_experts"),
    # Its top-k picks among n_routed_experts (the routed experts plus the zero-computation
    # ones); num_experts counts the routed experts only.
    "LongcatFlashTopkRouter": ("n_routed_experts", "top_k"),
    # Its top-k picks among num_router_classes: the experts plus a skip class (id num_experts,
    # handed on as expert 0 with weight 0).
    "ZayaRouter": ("num_router_classes", "top_k"),
}

_ROUTER_NAME = re.compile(r"(Router|Gating|Gate)$")
_LAYER = re.compile(r"^(?:(.*)\.)?layers\.(\d+)(?:\.|$)")
_DEFAULT_ATTRIBUTES = ("num_experts", "top_k")


@dataclass(frozen=True)
class RouteShape:
    """What one token's routes hold: one row per decoder layer, ``top_k`` expert ids each.

    Attributes:
        layers: Decoder layers (rows per token; dense layers' rows are unused).
        top_k: Experts each token picks per layer.
        num_experts: Experts per layer (ids are ``0 .. num_experts - 1``).
    """

    layers: int
    top_k: int
    num_experts: int

    def bytes_per_token(self) -> int:
        """Device memory replay holds per token while routes are set (int16 ids)."""
        return 2 * self.layers * self.top_k


@dataclass(frozen=True)
class FoundRouter:
    """One router replay drives.

    Attributes:
        fqn: Its name in the model.
        layer: Its absolute decoder-layer index (the row the engines give it).
        cls: Its model class name.
        module: The module. (Not compared.)
    """

    fqn: str
    layer: int
    cls: str
    module: nn.Module = field(compare=False, repr=False)


def router_class(module: nn.Module) -> type:
    """The model's own class of ``module``: FSDP2's ``fully_shard`` swaps in a subclass."""
    for cls in type(module).__mro__:
        if not cls.__module__.startswith("torch.distributed"):
            return cls
    return type(module)  # pragma: no cover - every module has a non-FSDP class


def _attribute(module: nn.Module, path: str) -> Any:
    value: Any = module
    for part in path.split("."):
        value = getattr(value, part, None)
    return value


def _sizes(module: nn.Module, name: str) -> tuple[int, int] | None:
    experts, top_k = (_attribute(module, p) for p in ATTRIBUTES.get(name, _DEFAULT_ATTRIBUTES))
    if isinstance(experts, int) and isinstance(top_k, int) and experts > 0 and top_k > 0:
        return experts, top_k
    return None


def find_routers(model: nn.Module) -> tuple[tuple[FoundRouter, ...], RouteShape]:
    """The routers of ``model`` replay drives, and the shape of one token's routes.

    Raises :class:`RoutingReplayError` naming the router where any router is refused
    (:data:`REFUSED`), outside a decoder layer, in another decoder than the others, or
    disagrees on experts or top-k; and where ``model`` has no router at all.
    """
    found: list[FoundRouter] = []
    sizes: dict[tuple[int, int], str] = {}
    decoders: dict[str, str] = {}
    for fqn, module in model.named_modules():
        name = router_class(module).__name__
        if name in REFUSED:
            raise RoutingReplayError(
                f"routing replay cannot drive {fqn!r} ({name}): {REFUSED[name]}; replay covers "
                "the top-k routers listed in docs/replay-families.md"
            )
        if not _ROUTER_NAME.search(name) or (shape := _sizes(module, name)) is None:
            continue
        if any(fqn.startswith(f.fqn + ".") for f in found):
            continue  # a router's own submodules (a gate inside a gating module)
        where = _LAYER.match(fqn)
        if where is None:
            raise RoutingReplayError(
                f"router {fqn!r} ({name}) is not in a decoder layer ('...layers.<i>...'): the "
                "engines key routes by decoder layer; replay one decoder (pass the submodule "
                "that holds its layers)"
            )
        decoders.setdefault(where.group(1) or "", fqn)
        sizes.setdefault(shape, fqn)
        found.append(FoundRouter(fqn, int(where.group(2)), name, module))
    if not found:
        raise RoutingReplayError(
            f"{type(model).__name__} has no router routing replay can drive (a module like "
            "'...Router' with num_experts and top_k, in a decoder layer); the families it "
            "covers are listed in docs/replay-families.md"
        )
    if len(decoders) > 1:
        raise RoutingReplayError(
            f"routers sit in {len(decoders)} decoders ({', '.join(sorted(decoders.values()))}): "
            "routes come for one decoder; replay the submodule that holds it"
        )
    by_layer: dict[int, str] = {}
    for router in found:
        if (other := by_layer.setdefault(router.layer, router.fqn)) != router.fqn:
            raise RoutingReplayError(
                f"routers {other!r} and {router.fqn!r} both sit in decoder layer {router.layer}: "
                "the engines give one row of routes per token and layer"
            )
    if len(sizes) > 1:
        described = ", ".join(f"{f!r}: {e} experts, top-{k}" for (e, k), f in sizes.items())
        raise RoutingReplayError(f"routers disagree on their experts or top-k: {described}")
    ((experts, top_k),) = sizes
    (prefix,) = decoders
    layers = model.get_submodule(f"{prefix}.layers" if prefix else "layers")
    return tuple(found), RouteShape(len(layers), top_k, experts)  # type: ignore[arg-type]
