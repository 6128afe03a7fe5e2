"""The seams of frameworks that call ``fully_shard`` themselves (docs/integrations.md): the HF
Trainer's plugin arguments, accelerate's FSDP2 on a CPU-only machine, a Trainer class that runs
FSDP2 on CPU, the Trainer checkpoint a resume can trust. Only public attributes of accelerate's
state are set; the package is imported lazily (an optional dependency)."""

from __future__ import annotations

import json
import os
import re
from typing import Any, TypeVar

from torch.distributed.fsdp import MixedPrecisionPolicy

__all__ = [
    "accelerate_fsdp2_on_cpu",
    "cpu_fsdp2_trainer",
    "last_complete_checkpoint",
    "trainer_fsdp_policy",
]

T = TypeVar("T", bound=type)


def trainer_fsdp_policy(args: Any, policy: MixedPrecisionPolicy) -> Any:
    """Give ``policy`` to the FSDP2 plugin an HF ``Trainer`` builds from ``args``; returns ``args``.

    Call it on the ``TrainingArguments`` (or TRL's ``SFTConfig``) after building them and before
    the ``Trainer``: ``Trainer.create_accelerator_and_postprocess`` builds
    ``FullyShardedDataParallelPlugin(**args.fsdp_plugin_args)``, and the plugin keeps the object.
    ``fsdp_config`` cannot carry it (unknown keys are dropped, and a policy object there breaks
    ``args.to_json_string()``). The Trainer's own ``bf16=True`` would give
    ``MixedPrecisionPolicy(bf16, bf16, bf16)`` (bf16 gradient reduction); with this policy
    ``reduce_dtype`` is the rules' (fp32 for the presets). ``dataclasses.replace(args, ...)``
    rebuilds ``fsdp_plugin_args``: call this again afterwards.

    Raises ``ValueError`` when ``args`` does not enable FSDP2 (``fsdp=...`` with
    ``fsdp_config={"version": 2}``, the default version in transformers 5).
    """
    if not isinstance(policy, MixedPrecisionPolicy):
        raise TypeError(
            f"policy must be a MixedPrecisionPolicy (e.g. fsdp_precision.model_policy(model, "
            f"rules)), got {type(policy).__name__}"
        )
    plugin_args = getattr(args, "fsdp_plugin_args", None)
    if not isinstance(plugin_args, dict) or plugin_args.get("fsdp_version") != 2:
        raise ValueError(
            f"{type(args).__name__} does not enable FSDP2 (fsdp_plugin_args is {plugin_args!r}); "
            "pass fsdp='full_shard' (or True) and fsdp_config={'version': 2} to the arguments"
        )
    plugin_args["mixed_precision_policy"] = policy
    return args


def accelerate_fsdp2_on_cpu(accelerator: Any, plugin: Any) -> None:
    """Make ``accelerator`` run FSDP2 with ``plugin`` on a CPU-only machine (gloo).

    accelerate 1.x sets ``DistributedType.FSDP`` only when it found an accelerator
    (``AcceleratorState``); with ``Accelerator(cpu=True, fsdp_plugin=...)`` under ``torchrun`` it
    keeps ``MULTI_CPU`` and drops the plugin, so ``prepare`` returns a
    ``DistributedDataParallel`` model. This does what ``AcceleratorState`` does on a GPU: the
    FSDP distributed type (also in the shared ``PartialState``, from which every later
    ``AcceleratorState()`` re-reads it), the plugin's mixed precision (a policy object given by
    the user is kept), and the plugin (the one given to the ``Accelerator``). Call it before
    ``prepare``. After ``prepare`` the parameters are DTensors.

    Raises ``RuntimeError`` unless the accelerator is ``MULTI_CPU`` (use ``cpu=True`` under
    ``torchrun``) and ``ValueError`` for a plugin that is not FSDP2.
    """
    from accelerate.state import PartialState  # lazy: an optional dependency
    from accelerate.utils import DistributedType  # lazy: an optional dependency

    state = accelerator.state
    if state.distributed_type == DistributedType.FSDP:
        return
    if state.distributed_type != DistributedType.MULTI_CPU:
        raise RuntimeError(
            f"accelerate_fsdp2_on_cpu needs a multi-process CPU accelerator, got "
            f"{state.distributed_type}: create Accelerator(cpu=True, ...) under torchrun "
            "(on a GPU machine accelerate enables FSDP itself)"
        )
    if getattr(plugin, "fsdp_version", None) != 2:
        raise ValueError(
            "accelerate_fsdp2_on_cpu needs an FSDP2 plugin: pass "
            "FullyShardedDataParallelPlugin(fsdp_version=2, ...), the one given to Accelerator"
        )
    state.distributed_type = DistributedType.FSDP
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    if state.mixed_precision != "no":
        plugin.set_mixed_precision(state.mixed_precision)  # keeps a policy object the user gave
    state.fsdp_plugin = plugin


def cpu_fsdp2_trainer(trainer_cls: T) -> T:
    """A subclass of an HF ``Trainer`` class (``transformers.Trainer``, TRL's ``SFTTrainer``, ...)
    that runs FSDP2 on a CPU-only machine (gloo), for tests and development boxes.

    Its ``create_accelerator_and_postprocess`` calls the original, then
    :func:`accelerate_fsdp2_on_cpu` with the plugin built from ``args.fsdp_plugin_args`` (the
    policy :func:`trainer_fsdp_policy` put there included), and marks FSDP enabled, which the
    Trainer had computed as off. Use ``TrainingArguments(use_cpu=True, fsdp=True, ...)`` under
    ``torchrun``. On GPUs use the Trainer class itself.
    """
    from accelerate import FullyShardedDataParallelPlugin  # lazy: an optional dependency

    original = getattr(trainer_cls, "create_accelerator_and_postprocess", None)
    if original is None:
        raise TypeError(
            f"{trainer_cls.__name__} has no create_accelerator_and_postprocess: pass an HF "
            "Trainer class (transformers.Trainer or a subclass such as trl.SFTTrainer)"
        )

    def create_accelerator_and_postprocess(self: Any) -> None:
        original(self)
        plugin = FullyShardedDataParallelPlugin(**self.args.fsdp_plugin_args)
        accelerate_fsdp2_on_cpu(self.accelerator, plugin)
        self.is_fsdp_enabled = True

    name = f"CpuFsdp2{trainer_cls.__name__}"
    namespace = {
        "create_accelerator_and_postprocess": create_accelerator_and_postprocess,
        "__doc__": f"{trainer_cls.__name__} running FSDP2 on CPU (fsdp_precision).",
        "__module__": __name__,
    }
    return type(name, (trainer_cls,), namespace)  # type: ignore[return-value]


_CHECKPOINT = re.compile(r"checkpoint-(\d+)")
#: The file the HF Trainer writes last into a ``checkpoint-N`` (``TRAINER_STATE_NAME``).
_TRAINER_STATE = "trainer_state.json"


def last_complete_checkpoint(output_dir: str | os.PathLike[str]) -> str | None:
    """The newest ``checkpoint-N`` in ``output_dir`` that the HF Trainer finished writing, or
    ``None`` when there is none (or no ``output_dir``): pass it to ``trainer.train(
    resume_from_checkpoint=...)``.

    The Trainer's save is not atomic: it writes ``checkpoint-N`` in place (the weights, config
    and ``training_args.bin``, then the optimizer, scheduler and RNG states) and
    ``trainer_state.json`` last. A run killed mid-save leaves a ``checkpoint-N`` without it,
    which transformers' ``get_last_checkpoint`` (and ``resume_from_checkpoint=True``) still
    picks, by name alone; resuming from it fails or restarts the schedule. Here a checkpoint is
    complete when its ``trainer_state.json`` parses and names a ``global_step``. Local (no
    collective): every rank reads the same directory.
    """
    root = os.fspath(output_dir)
    if not os.path.isdir(root):
        return None
    found: list[tuple[int, str]] = []
    for name in os.listdir(root):
        match = _CHECKPOINT.fullmatch(name)
        path = os.path.join(root, name)
        if match is not None and os.path.isdir(path) and _trainer_state_written(path):
            found.append((int(match.group(1)), path))
    return max(found)[1] if found else None


def _trainer_state_written(checkpoint: str) -> bool:
    """Whether ``checkpoint/trainer_state.json`` is there, whole (a JSON object with a step)."""
    try:
        with open(os.path.join(checkpoint, _TRAINER_STATE), encoding="utf-8") as f:
            state = json.load(f)
    except (OSError, ValueError):
        return False
    return isinstance(state, dict) and isinstance(state.get("global_step"), int)
