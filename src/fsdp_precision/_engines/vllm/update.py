"""Updating a running vLLM engine in place: from the trainer's process, or from another one.

- :func:`update_weights` (the engine runs in the trainer's process: vLLM's V1 engine with
  ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, or the external launcher): the weights go through vLLM's
  own ``reload_weights`` (the direct ``model.load_weights`` fails on the CPU build, whose linear
  layers hold a prepacked handle instead of their weight). A model vLLM loaded without the
  export record holds kept tensors in the bulk dtype: an update that keeps some is refused
  before anything is loaded.
- :class:`WeightReceiver` (an engine in its own processes): vLLM's ``worker_extension_cls``,
  whose methods the trainer's side reaches through ``collective_rpc``: join a weight group, then
  receive what :func:`~fsdp_precision.integrations.send_weights` broadcasts (the metadata, then
  the tensors in their dtypes) straight into ``reload_weights``.

Either way, a model with the record checks every kept tensor after the load
(:class:`.hold.Held`), and the expert layers' post-load processing runs again where vLLM's update
path skips it (:mod:`.experts`). No import of vLLM: the engine is the caller's.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.nn as nn

from fsdp_precision._base.dtypes import dtype_name
from fsdp_precision._engines.readback import raise_problems
from fsdp_precision._engines.transfer import receive_weights, weight_group
from fsdp_precision._engines.vllm.experts import repair_expert_updates
from fsdp_precision._engines.vllm.hold import fused_of, narrower, renamer_of

__all__ = ["WeightReceiver", "update_weights"]


def _kept_of(weights: Any) -> dict[str, torch.dtype]:
    """The kept dtypes ``weights`` declares up front (a stream's or a receiver's metadata)."""
    kept = getattr(weights, "kept", None)
    if isinstance(kept, Mapping):
        return {n: (m.dtype if hasattr(m, "dtype") else m) for n, m in kept.items()}
    return {}


def _refuse_rounding(model: nn.Module, kept: Mapping[str, torch.dtype]) -> None:
    """A model loaded without the record (not built to hold what was kept) would round the kept
    tensors of an update: refuse, naming them, before anything is loaded."""
    if not kept or getattr(model, "_fsdp_precision_held", None) is not None:
        return
    params = dict(model.named_parameters(remove_duplicate=False))
    rename, fused = renamer_of(type(model)), fused_of(type(model))
    problems = []
    for name, dtype in sorted(kept.items()):
        held = params.get(rename(name) or "") if not fused(name) else None
        if held is None or held.dtype != dtype:
            where = dtype_name(held.dtype) if held is not None else "it in the bulk dtype"
            problems.append(f"{name}: sent in {dtype_name(dtype)}, the engine holds {where}")
    raise_problems(
        problems,
        "the engine would round what training kept: it was loaded from a directory without "
        "fsdp-precision's export record",
        "Start vLLM from an export_safetensors() directory (its fsdp_precision_export.json makes "
        "the plugin allocate kept tensors in their dtype), or send with cast_kept=True",
    )


def _refuse_narrower(model: nn.Module, weights: Any) -> None:
    """A model built to hold kept tensors refuses, before anything loads, an update whose
    metadata (a stream's) or materialised list brings one in a narrower dtype; a lazy iterator
    is checked tensor by tensor as it loads (:meth:`.hold.Held.load`)."""
    held = getattr(model, "_fsdp_precision_held", None)
    if held is None:
        return
    kept = held.build.kept.tensors
    metadata = getattr(weights, "metadata", None)
    if metadata is not None:
        sent = [(m.name, m.dtype) for m in metadata]
    elif isinstance(weights, (list, tuple)):
        sent = [(name, tensor.dtype) for name, tensor in weights]
    else:
        return
    raise_problems(
        [
            f"{name}: sent in {dtype_name(dtype)}, kept in {dtype_name(kept[name])}"
            for name, dtype in sent
            if name in kept and narrower(dtype, kept[name])
        ],
        "an update brought kept tensors in a narrower dtype (refused before anything loaded)",
        "Send each tensor in the dtype training kept it (fsdp_precision.full_weights(model)); "
        "never cast the whole state dict to the rollout dtype",
    )


def _model_of(worker: Any) -> nn.Module:
    runner = worker.model_runner
    return runner.get_model() if hasattr(runner, "get_model") else runner.model  # type: ignore[no-any-return]


def _update_in_worker(worker: Any, weights: Iterable[tuple[str, torch.Tensor]], kept: Any) -> int:
    model = _model_of(worker)
    _refuse_rounding(model, kept)
    _refuse_narrower(model, weights)
    repair_expert_updates(model)
    count = 0

    def counted() -> Iterable[tuple[str, torch.Tensor]]:
        nonlocal count
        for item in weights:
            count += 1
            yield item

    worker.reload_weights(weights_iterator=counted(), is_checkpoint_format=True)
    return count


def update_weights(llm: Any, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
    """Load ``weights`` into the running engine ``llm`` (a ``vllm.LLM`` in this process), in
    place: a :class:`~fsdp_precision.WeightStream` (Hugging Face names, kept tensors in their
    dtypes) or any iterable of ``(name, tensor)``. Returns the number of tensors loaded.

    Kept tensors land exactly where the engine was started from an export with the record (the
    plugin built them in their dtype; each is read back after the load); where it was not, an
    update that keeps tensors is refused before anything is loaded. vLLM runs the model in
    another process unless ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (or the external launcher): use
    :class:`WeightReceiver` there."""
    kept = _kept_of(weights)
    try:
        results = llm.collective_rpc(_update_in_worker, args=(weights, kept))
    except (TypeError, AttributeError) as err:
        if "pickle" in str(err).lower() or "serializ" in str(err).lower():
            raise ValueError(
                "update_weights needs the engine in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0 "
                "or distributed_executor_backend='external_launcher'); for an engine in its own "
                "processes start it with worker_extension_cls='fsdp_precision.integrations.vllm."
                "WeightReceiver' and send with send_weights"
            ) from err
        raise
    return int(results[0])


class WeightReceiver:
    """vLLM worker extension (``LLM(..., worker_extension_cls=
    "fsdp_precision.integrations.vllm.WeightReceiver")``): the engine's side of
    :func:`~fsdp_precision.integrations.send_weights`.

    From the process that holds the ``LLM``: ``llm.collective_rpc("fsdp_precision_join",
    args=(address, port, rank, world_size))`` once (every worker joins the weight group at
    ``rank + its own rank``), then per update ``llm.collective_rpc("fsdp_precision_receive")``
    while the trainer sends."""

    def fsdp_precision_join(
        self, address: str, port: int, rank: int, world_size: int, backend: str = "gloo"
    ) -> None:
        """Join the weight group (rank ``rank`` plus this worker's rank in the engine)."""
        own = int(getattr(self, "rank", 0))
        self._fsdp_precision_group = weight_group(
            address, port, rank + own, world_size, backend=backend
        )

    def fsdp_precision_receive(self, src: int = 0) -> int:
        """Receive one update from rank ``src`` of the weight group into the model, in place;
        the number of tensors loaded. Whatever goes wrong (a kept tensor the engine would round,
        refused before anything loads; an error while loading) the update is received to its end
        before the error is raised here: the sender finishes its broadcasts, never left
        waiting."""
        group = getattr(self, "_fsdp_precision_group", None)
        if group is None:
            raise RuntimeError("call fsdp_precision_join before fsdp_precision_receive")
        model = _model_of(self)
        device = next(model.parameters()).device
        weights = receive_weights(group, src=src, device=device)
        remaining = iter(weights)
        try:
            _refuse_rounding(model, weights.kept)
            return _update_in_worker(self, remaining, {})
        except BaseException:
            for _ in remaining:  # take part in every broadcast left, keep nothing
                pass
            raise
