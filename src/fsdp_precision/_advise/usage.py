"""Where each parameter is used: the facts that call-aware auto-wrap needs.

FSDP gathers a unit's parameters in the unit's forward pre-hook and frees them after its
forward. A parameter used while its unit is not running is still sharded (a DTensor in an op,
"mixed torch.Tensor and DTensor") or still in its storage dtype (``self.dtype`` reads fp32 while
the unit computes in bf16). A module may own a parameter as a unit only when every use of that
parameter happens while the module's forward is running.

A :class:`Use` is one such fact: a parameter, the modules whose forward was running, and how it
was used. :func:`param_usage` collects them from two sources:

* **A traced forward** on the model as it is (on the meta device when the model is there), with
  the caller's example inputs or the model's own ``dummy_inputs``: a torch-function mode records
  every op and attribute read (``.dtype``) that touches a parameter, and global module hooks
  record which forwards are running. No gradient, no randomness consumed (the RNG is forked),
  training flags restored. A forward that fails part-way keeps what it saw.
* **Static facts** that hold on every input, from the model's own class code (not library
  base classes): a model whose code calls ``self.get_input_embeddings()`` (or
  ``get_output_embeddings()``) runs that module from its own forward (multimodal models embed
  tokens in the outer model), and a model whose code reads ``self.dtype`` reads the parameter
  that property picks.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from torch.utils import _pytree as pytree

from fsdp_precision._base.watch import ROOT, ParamWatch, RunningModules, attribute_read
from fsdp_precision._hf.tracing import traceable_cache, traceable_experts, traceable_meta

__all__ = [
    "ParamUsage",
    "Use",
    "call_forward",
    "default_inputs",
    "first_line",
    "on_model_device",
    "param_usage",
    "quiet_forward",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Use:
    """One use of a parameter.

    Attributes:
        param: The parameter's root-relative FQN (its first name).
        where: FQN of the innermost module whose forward was running (``"<root>"``).
        how: What used it (``"aten op embedding"``, ``"reads .dtype"``, ...).
        active: FQNs of every module whose forward was running.
        source: ``"traced forward"`` or the static fact it comes from.
    """

    param: str
    where: str
    how: str
    active: frozenset[str]
    source: str


@dataclass(frozen=True)
class ParamUsage:
    """Every recorded :class:`Use`, by parameter, and how they were gathered.

    Attributes:
        uses: ``FQN -> uses`` (distinct sets of running forwards per parameter).
        traced: What the traced forward ran on, or why there was none.
    """

    uses: Mapping[str, tuple[Use, ...]]
    traced: str

    def outside(self, module: str, params: list[str]) -> Use | None:
        """The first use of one of ``params`` while ``module``'s forward was not running."""
        for name in params:
            for use in self.uses.get(name, ()):
                if module not in use.active:
                    return use
        return None


def _param_names(model: nn.Module) -> dict[int, str]:
    return {id(p): n for n, p in model.named_parameters()}


class _Recorder(ParamWatch):
    """Records, for every torch function touching a parameter, the forwards running then."""

    def __init__(self, params: dict[int, str], stack: list[str], *, dtype_only: bool = False):
        super().__init__(params)
        self.params = params
        self.stack = stack
        self.dtype_only = dtype_only
        #: (parameter FQN, running forwards) -> (how it was used, innermost running forward)
        self.seen: dict[tuple[str, frozenset[str]], tuple[str, str]] = {}

    def touched(self, func: Callable[..., Any], tensor: torch.Tensor) -> None:
        attribute = attribute_read(func)
        if self.dtype_only and attribute != "dtype":
            return
        how = f"reads .{attribute}" if attribute else f"op {getattr(func, '__name__', '')}"
        key = (self.params[id(tensor)], frozenset(self.stack))
        self.seen.setdefault(key, (how, self.stack[-1] if self.stack else ROOT))


def default_inputs(model: nn.Module) -> tuple[Any, str] | None:
    """The model's own ``dummy_inputs`` (Hugging Face models) and where they come from."""
    try:
        dummy = getattr(model, "dummy_inputs", None)
    except Exception:  # noqa: BLE001 - a property that cannot build inputs
        return None
    if isinstance(dummy, Mapping) and dummy:
        return dict(dummy), f"{type(model).__name__}.dummy_inputs"
    return None


def on_model_device(model: nn.Module, inputs: Any) -> Any:
    """``inputs`` with every tensor moved to the device of ``model``'s parameters (call it
    before a watch starts: it reads a parameter's ``.device``)."""
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    return pytree.tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, inputs)


def call_forward(model: nn.Module, inputs: Any) -> Any:
    """``model`` called on ``inputs``: a mapping (keyword arguments), a tuple or list
    (positional arguments) or one tensor."""
    if isinstance(inputs, Mapping):
        return model(**inputs)
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    return model(inputs)


#: bitsandbytes' ``Linear4bit``/``Embedding4bit`` attribute that lets an eval-mode no-grad
#: forward repack the weight in place for its AVX-512-BF16 CPU kernel (bitsandbytes 0.48+).
_REPACK_FLAG = "support_avx512bf16_for_cpu"


@contextmanager
def quiet_forward(
    model: nn.Module, *, eval_mode: bool = True, experts: str = "batched_mm"
) -> Iterator[None]:
    """For a traced forward: eval mode (with ``eval_mode=False`` the model's own mode, but
    batch norms in eval mode: a train-mode forward updates their running statistics), no
    gradient, the RNG forked (dropout consumes none), fused experts on ``experts``, an
    implementation every dtype runs (:func:`~fsdp_precision._hf.tracing.traceable_experts`:
    ``"batched_mm"`` on the meta device too, ``"eager"`` in bounded memory on values), and no
    layer rewriting its weights in place (bitsandbytes' 4-bit layers repack theirs into a CPU
    layout at their first eval-mode no-grad forward on AVX-512-BF16 CPUs, which FSDP's sharding
    of the original codes then contradicts: the trace a plan runs broke QLoRA there);
    everything restored."""
    flags = [(m, m.training) for m in model.modules()]
    repacking = [(m, getattr(m, _REPACK_FLAG)) for m in model.modules() if hasattr(m, _REPACK_FLAG)]
    devices = sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})
    try:
        with (
            torch.random.fork_rng(devices=devices),
            torch.no_grad(),
            traceable_experts(model, experts),
            traceable_cache(model),
            traceable_meta(),
        ):
            if eval_mode:
                model.eval()
            for module in model.modules():
                if isinstance(module, nn.modules.batchnorm._NormBase):
                    module.eval()
            for module, _ in repacking:
                setattr(module, _REPACK_FLAG, False)
            yield
    finally:
        for module, training in flags:
            module.training = training
        for module, flag in repacking:
            setattr(module, _REPACK_FLAG, flag)


def _trace(
    model: nn.Module, inputs: Any, params: dict[int, str]
) -> tuple[dict[tuple[str, frozenset[str]], tuple[str, str]], str]:
    moved = on_model_device(model, inputs)
    running = RunningModules(model)
    recorder = _Recorder(params, running.stack)
    error = ""
    with quiet_forward(model), running, recorder:
        try:
            call_forward(model, moved)
        except Exception as exc:  # noqa: BLE001 - keep what the forward saw before failing
            error = first_line(exc)
    return recorder.seen, error


def first_line(exc: BaseException) -> str:
    """``"Type: first line of the message"``, at most 160 characters."""
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:160]


def _is_model_code(module: str) -> bool:
    """Whether a class from ``module`` is a model's own code rather than a library base class or
    mixin (torch, transformers' and diffusers' shared machinery, accelerate, peft)."""
    if module.startswith(("transformers.", "diffusers.")):
        return ".models." in module and not module.endswith("modeling_utils")
    return not module.startswith(("torch.", "accelerate.", "peft.", "builtins"))


_CODE_CACHE: dict[tuple[str, str, str], bool] = {}


def _own_code_contains(cls: type, text: str) -> bool:
    """Whether the model's own class code (its classes, not library bases) contains ``text``
    (cached per class: ``inspect.getsource`` rescans the file)."""
    key = (cls.__module__, cls.__qualname__, text)
    if key not in _CODE_CACHE:
        _CODE_CACHE[key] = _scan(cls, text)
    return _CODE_CACHE[key]


def _scan(cls: type, text: str) -> bool:
    for klass in cls.__mro__:
        if not _is_model_code(getattr(klass, "__module__", "") or ""):
            continue
        try:
            source = inspect.getsource(klass)
        except (OSError, TypeError):
            continue
        if text in source:
            return True
    return False


def _path(name: str) -> frozenset[str]:
    """The FQNs of ``name`` and every module above it (whose forwards enclose its forward)."""
    if name == ROOT:
        return frozenset({ROOT})
    parts = name.split(".")
    return frozenset({ROOT} | {".".join(parts[:i]) for i in range(1, len(parts) + 1)})


def _static_uses(model: nn.Module, modules: dict[int, str], params: dict[int, str]) -> list[Use]:
    uses: list[Use] = []
    for module in model.modules():
        name = modules[id(module)]
        for getter in ("get_input_embeddings", "get_output_embeddings"):
            fn = getattr(module, getter, None)
            if not callable(fn) or not _own_code_contains(type(module), f"self.{getter}()"):
                continue
            try:
                target = fn()
            except Exception:  # noqa: BLE001 - NotImplementedError and friends: no such fact
                continue
            if not isinstance(target, nn.Module) or id(target) not in modules:
                continue
            called = modules[id(target)]
            for local, param in target.named_parameters():
                if id(param) not in params:
                    continue
                # The called module and every module between it and the parameter's owner run.
                segments = local.split(".")[:-1]
                prefix = "" if called == ROOT else called + "."
                inner = {prefix + ".".join(segments[:i]) for i in range(1, len(segments) + 1)}
                active = _path(name) | {called} | inner
                uses.append(
                    Use(params[id(param)], name, f"calls {getter}()", active, f"{getter}()")
                )
        if "dtype" in dir(type(module)) and _own_code_contains(type(module), "self.dtype"):
            recorder = _Recorder(params, list(_path(name)), dtype_only=True)
            try:
                with recorder:
                    _ = module.dtype
            except Exception:  # noqa: BLE001 - no floating parameter: nothing to read
                continue
            for fqn, _active in recorder.seen:
                uses.append(Use(fqn, name, "reads self.dtype", _path(name), "self.dtype"))
    return uses


def param_usage(model: nn.Module, example_inputs: Any = None) -> ParamUsage:
    """The uses of ``model``'s parameters: one traced forward plus the static facts.

    ``example_inputs``: a mapping (keyword arguments), a tuple (positional arguments) or one
    tensor for ``model``'s forward; default: the model's ``dummy_inputs`` when it has them
    (Hugging Face models). Without inputs, or when the forward fails, the static facts still
    apply and ``traced`` says why.
    """
    modules = {id(m): (n or ROOT) for n, m in model.named_modules()}
    params = _param_names(model)
    uses = _static_uses(model, modules, params)
    chosen = (example_inputs, "example_inputs") if example_inputs is not None else None
    chosen = chosen or default_inputs(model)
    if chosen is None:
        traced = "no forward traced: no example_inputs and no dummy_inputs (static facts only)"
    else:
        seen, error = _trace(model, chosen[0], params)
        for (param, active), (how, where) in seen.items():
            uses.append(Use(param, where, how, active, "traced forward"))
        traced = f"traced a forward on {chosen[1]}" + (
            f" (it stopped early: {error}; what ran before is used)" if error else ""
        )
        if error:
            logger.info("fsdp_precision: %s", traced)
    by_param: dict[str, list[Use]] = {}
    for use in uses:
        by_param.setdefault(use.param, []).append(use)
    return ParamUsage({k: tuple(v) for k, v in by_param.items()}, traced)
