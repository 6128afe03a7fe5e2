"""One vLLM model's kept tensors: allocated in their dtype while it is built, checked after every
load, refused by name where the engine cannot hold them.

While the integration's model class builds vLLM's (:mod:`.models`), :func:`building` gives the
layers the kept dtypes by engine name: a router ``GateLinear`` is built with its weight in the
kept dtype and fp32 logits (:mod:`.layers`). After the build, :class:`Held` finds every kept
tensor among the model's parameters: allocated in its dtype already (the gate; an fp32
``e_score_correction_bias`` vLLM allocates so itself), or converted (a kept norm's weight
re-allocated in its dtype, its module given the boundary cast training ran it with), or refused
(fused into another tensor, or a module whose layout the integration does not convert) with an
:class:`~fsdp_precision.EngineDtypeError` naming it, before any weight is read.

Every ``load_weights`` (the first load, ``reload_weights``, a direct call) passes through
:meth:`Held.load`: the kept tensors are copied aside as they go by, and afterwards read back
from the engine (or, where its kernel hides the weight, probed through the module's own
forward): a tensor the engine rounded raises by name.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from fsdp_precision._base.dtypes import dtype_name
from fsdp_precision._engines.declaration import CONFIG_KEY, resolve_kept
from fsdp_precision._engines.kept import EngineKept
from fsdp_precision._engines.readback import compare_held, probe_linear, raise_problems
from fsdp_precision._policy.casts import ModuleCast, install_cast, installed_cast

__all__ = [
    "Build",
    "Held",
    "build",
    "building",
    "fused_of",
    "kept_of_config",
    "narrower",
    "renamer_of",
]

logger = logging.getLogger(__name__)

_FIX = (
    "Serve this model with an architecture fsdp-precision's vLLM integration covers "
    "(docs/after-training.md, 'vLLM'), or export it without keeping that tensor"
)


def kept_of_config(config: Any) -> EngineKept | None:
    """What the engine of vLLM's ``config`` (a ``VllmConfig``) must keep: its
    ``additional_config["fsdp_precision"]``, ``FSDP_PRECISION_KEPT``, or the model's export
    record (a directory or a Hub id): :func:`~fsdp_precision._engines.declaration.resolve_kept`."""
    model_config = config.model_config
    additional = getattr(config, "additional_config", None)
    declared = additional.get(CONFIG_KEY) if isinstance(additional, Mapping) else None
    return resolve_kept(
        str(model_config.model),
        revision=getattr(model_config, "revision", None),
        declared=declared,
    )


def narrower(sent: torch.dtype, kept: torch.dtype) -> bool:
    """Whether a tensor sent in ``sent`` cannot carry every value of ``kept`` (bf16 for fp32;
    fp16 and bf16 for each other); fp64 for fp32 is wider, the copy exact to the kept dtype."""
    return sent != kept and torch.promote_types(sent, kept) != sent


def renamer_of(cls: type[nn.Module]) -> Callable[[str], str | None]:
    """Checkpoint name -> engine name, by the vLLM model class's own ``hf_to_vllm_mapper``."""
    mapper = getattr(cls, "hf_to_vllm_mapper", None)
    if mapper is None:
        return lambda name: name
    return mapper.map_name  # type: ignore[no-any-return]


def fused_of(cls: type[nn.Module]) -> Callable[[str], bool]:
    """Whether the class's mapper loads a checkpoint name as a shard of a fused tensor (its
    ``orig_to_new_stacked``: ``.q_proj`` into ``.qkv_proj``). Hand-written loaders fuse without
    the mapper: their names map to no engine parameter, which the build refuses as well."""
    stacked = tuple(getattr(getattr(cls, "hf_to_vllm_mapper", None), "orig_to_new_stacked", {}))
    return lambda name: any(f"{key}." in name for key in stacked)


@dataclass(frozen=True)
class Build:
    """What the layers of the model being built should hold: engine name -> kept dtype.

    Attributes:
        kept: The description the model directory's record gave.
        architecture: The model's architecture name.
        engine_names: Each kept tensor's engine name -> its checkpoint name.
        fused: Kept checkpoint names the engine loads as one shard of a fused tensor -> that
            tensor's engine name.
        engine_dtype: The dtype the engine runs the model in (``None``: the record's bulk):
            what a kept module's outputs are cast back to.
    """

    kept: EngineKept
    architecture: str
    engine_names: dict[str, str] = field(default_factory=dict)
    fused: dict[str, str] = field(default_factory=dict)
    engine_dtype: torch.dtype | None = None

    def dtype_of(self, engine_name: str) -> torch.dtype | None:
        """The kept dtype of the engine tensor ``engine_name`` (``None``: the bulk)."""
        checkpoint = self.engine_names.get(engine_name)
        return None if checkpoint is None else self.kept.tensors[checkpoint]


_BUILD: ContextVar[Build | None] = ContextVar("fsdp_precision_vllm_build", default=None)


def building() -> Build | None:
    """The build in progress in this context (``None``: no kept model is being built)."""
    return _BUILD.get()


@contextmanager
def build(
    kept: EngineKept,
    architecture: str,
    rename: Callable[[str], str | None],
    fused: Callable[[str], bool] = lambda name: False,
    engine_dtype: torch.dtype | None = None,
) -> Iterator[Build]:
    """Make :func:`building` return the build of a model whose checkpoint names map to engine
    names by ``rename`` (``None``: the engine drops the name); ``fused`` says which checkpoint
    names the engine loads as a shard of a fused tensor (q/k/v into ``qkv_proj``)."""
    names, shards = {}, {}
    for checkpoint in kept.tensors:
        engine = rename(checkpoint)
        if engine is not None and fused(checkpoint):
            shards[checkpoint] = engine
        elif engine is not None:
            names[engine] = checkpoint
    current = Build(kept, architecture, names, shards, engine_dtype)
    token = _BUILD.set(current)
    try:
        yield current
    finally:
        _BUILD.reset(token)


class Held:
    """The kept tensors of one built model, and the checks after each of its loads."""

    def __init__(
        self,
        model: nn.Module,
        current: Build,
        *,
        elsewhere: Callable[[str], bool] = lambda name: False,
        checkpoint_load: bool = False,
    ) -> None:
        """``elsewhere(engine_name)``: the tensor lives on another pipeline stage (this stage
        neither holds nor checks it). ``checkpoint_load``: the engine's first load reads the
        model's own checkpoint (vLLM's loader, not ``load_format="dummy"``): a base checkpoint
        stores a kept tensor in the bulk dtype, widened exactly; every later load must bring it
        in its kept dtype."""
        self.build = current
        self.elsewhere = elsewhere
        self._checkpoint_load = checkpoint_load
        params = dict(model.named_parameters(remove_duplicate=False))
        modules = dict(model.named_modules(remove_duplicate=False))
        problems: list[str] = []
        dropped = sorted(
            set(current.kept.tensors) - set(current.engine_names.values()) - set(current.fused)
        )
        problems += [f"{name}: vLLM's {current.architecture} drops it on load" for name in dropped]
        problems += [
            f"{name}: vLLM's {current.architecture} loads it as one shard of the fused "
            f"{engine!r}, held in the bulk dtype {dtype_name(current.kept.bulk)} with the others"
            for name, engine in sorted(current.fused.items())
        ]
        converted = []
        for engine, checkpoint in sorted(current.engine_names.items()):
            dtype = current.kept.tensors[checkpoint]
            param = params.get(engine)
            if param is None and elsewhere(engine):
                continue  # another pipeline stage holds (and checks) it
            if param is None:
                problems.append(
                    f"{checkpoint}: vLLM's {current.architecture} holds no tensor of that name "
                    f"(it is {engine!r} there, fused into another tensor or absent), so it "
                    f"would be loaded in the bulk dtype {dtype_name(current.kept.bulk)}"
                )
            elif param.dtype != dtype:
                why = self._convert(modules, engine, checkpoint, param, dtype)
                if why:
                    problems.append(why)
                else:
                    converted.append(engine)
        raise_problems(
            problems, f"vLLM cannot hold what training kept ({current.kept.source})", _FIX
        )
        self.converted = converted
        logger.info(
            "fsdp-precision: %s, held as trained in vLLM's %s (%d converted after the build)",
            current.kept.describe(),
            current.architecture,
            len(converted),
        )

    def _convert(
        self,
        modules: dict[str, nn.Module],
        engine: str,
        checkpoint: str,
        param: nn.Parameter,
        dtype: torch.dtype,
    ) -> str | None:
        """Re-allocate ``param`` in ``dtype`` and give its module the boundary cast training ran
        it with; the reason it cannot be done, where it cannot."""
        owner_name, _, attr = engine.rpartition(".")
        owner = modules.get(owner_name)
        recorded = self.build.kept.cast_of(checkpoint.rpartition(".")[0])
        kind = type(owner).__name__
        if owner is None or owner._parameters.get(attr) is not param:
            return f"{checkpoint}: vLLM shares {engine!r} with another module; it cannot be kept"
        if recorded is None and installed_cast(owner) is None:
            return (
                f"{checkpoint}: vLLM's {kind} {owner_name!r} holds it in "
                f"{dtype_name(param.dtype)}, and training recorded no boundary cast for the "
                f"module to compute it in {dtype_name(dtype)}"
            )
        if recorded is not None and not recorded.cast.outputs:
            return (
                f"{checkpoint}: training's {kind} {owner_name!r} returned its outputs in "
                f"{dtype_name(dtype)}, which would reach vLLM's {dtype_name(param.dtype)} "
                "kernels; only routers (built by the integration) and modules whose outputs "
                "are cast back (norms) are held in another dtype"
            )
        param.data = torch.empty_like(param.data, dtype=dtype)  # the same Parameter, its loader
        if recorded is not None and installed_cast(owner) is None:
            back = recorded.back
            if back is not None and self.build.engine_dtype is not None:
                back = self.build.engine_dtype  # the engine's dtype (fp16 serving a bf16 run)
            install_cast(owner, ModuleCast(recorded.cast.inputs, recorded.cast.outputs), back)
        return None

    def load(
        self,
        model: nn.Module,
        load: Callable[[Iterable[tuple[str, torch.Tensor]]], Any],
        weights: Iterable[tuple[str, torch.Tensor]],
        rename: Callable[[str], str | None],
    ) -> Any:
        """``load(weights)`` (vLLM's own ``load_weights``), keeping a copy of each kept tensor as
        it goes by; then read each back from the engine and raise where it was rounded.

        A kept tensor arriving in a dtype that cannot hold its kept dtype's values (bf16 for an
        fp32 router: a sync that cast the state dict to the rollout dtype) is refused by name on
        every path into ``load_weights`` (vLLM's RL API, ``reload_weights``, a direct call as TRL
        makes): it never reaches the engine, which keeps that tensor's previous values; the rest
        of the call loads (vLLM's in-place reload must see its end to put its layers back), then
        the refusal is raised. The engine's first load of its own checkpoint (a base model's
        bf16 router) is the exception: widened exactly.
        """
        kept = self.build.kept.tensors
        seen: dict[str, torch.Tensor] = {}
        refused: list[str] = []
        from_checkpoint, self._checkpoint_load = self._checkpoint_load, False

        def tap() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                dtype = kept.get(name)
                if dtype is not None and not from_checkpoint and narrower(tensor.dtype, dtype):
                    refused.append(
                        f"{name}: sent in {dtype_name(tensor.dtype)}, kept in {dtype_name(dtype)}"
                    )
                    continue
                if dtype is not None:
                    seen[name] = tensor.detach().to("cpu", dtype=dtype, copy=True)
                yield name, tensor

        loaded = load(tap())
        self.check(model, seen, rename)
        raise_problems(
            refused,
            "an update brought kept tensors in a narrower dtype (those were not loaded: the "
            "engine holds their previous values)",
            "Send each tensor in the dtype training kept it (fsdp_precision.full_weights(model), "
            "or the integration's WeightSource); never cast the whole state dict to the rollout "
            "dtype",
        )
        return loaded

    def check(
        self, model: nn.Module, seen: dict[str, torch.Tensor], rename: Callable[[str], str | None]
    ) -> None:
        """Read back each kept tensor in ``seen`` (checkpoint name -> what was loaded)."""
        params = dict(model.named_parameters(remove_duplicate=False))
        modules = dict(model.named_modules(remove_duplicate=False))
        kept = self.build.kept
        problems: list[str | None] = []
        for checkpoint, value in sorted(seen.items()):
            engine = rename(checkpoint)
            dtype = kept.tensors[checkpoint]
            held = params.get(engine) if engine is not None else None
            if held is None and engine is not None and self.elsewhere(engine):
                continue  # another pipeline stage's
            if held is None or engine is None:
                problems.append(f"{checkpoint}: the engine holds no tensor {engine!r}")
            elif held.numel() == 0 and value.numel() > 0:
                # a kernel holds the weight (vLLM's CPU linear layers): read what it computes
                problems.append(self._probe(modules, engine, checkpoint, value, seen, dtype))
            else:
                problems.append(compare_held(checkpoint, held, value, dtype))
        raise_problems(
            [p for p in problems if p],
            f"vLLM rounded what training kept (loaded from {kept.source})",
            _FIX,
        )

    def _probe(
        self,
        modules: dict[str, nn.Module],
        engine: str,
        checkpoint: str,
        value: torch.Tensor,
        seen: dict[str, torch.Tensor],
        dtype: torch.dtype,
    ) -> str | None:
        owner_name, _, attr = engine.rpartition(".")
        owner = modules.get(owner_name)
        if owner is None or attr != "weight" or value.dim() != 2:
            return f"{checkpoint}: the engine hides it and the integration cannot probe {engine!r}"
        bias_name = checkpoint.rpartition(".")[0] + ".bias"
        bias = seen.get(bias_name)
        own_bias = getattr(owner, "bias", None)
        if bias is None and isinstance(own_bias, torch.Tensor):
            bias = own_bias

        def forward(x: torch.Tensor) -> torch.Tensor:
            with torch.no_grad():
                out = owner(x)
            result: torch.Tensor = out[0] if isinstance(out, tuple) else out
            return result

        device = next((p.device for p in owner.parameters()), torch.device("cpu"))
        return probe_linear(checkpoint, forward, value, bias, dtype, self.build.kept.bulk, device)
