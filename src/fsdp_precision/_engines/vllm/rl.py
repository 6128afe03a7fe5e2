"""vLLM's RL weight-sync API over the library's wire: the backend ``"fsdp_precision_gloo"``.

vLLM 0.32's RL API (``LLM.init_weight_transfer_engine`` / ``start_weight_update`` /
``update_weights`` / ``finish_weight_update``, the same routes on ``vllm serve``) moves weights
through a backend its factories name; its own are NCCL or CUDA IPC. This one is the library's
wire (:mod:`fsdp_precision._engines.transfer`: every tensor in its own dtype, packed in
16-byte-aligned buckets, one broadcast per bucket) over a weight group of its own
(:func:`~fsdp_precision._engines.transfer.weight_group`): gloo between CPU processes, NCCL
where the group says so (buffers on the group's device). vLLM's update request carries the
metadata (``names``, ``dtype_names``, ``shapes``, as its NCCL backend's does).

- :class:`KeptWeightTransferEngine`: the worker's side. Before it takes any tensor into the
  model it checks the request against what the engine holds and refuses by name
  (:class:`~fsdp_precision.EngineDtypeError`) a kept tensor sent narrower than training kept it
  and a tensor sent wider than the engine holds it (rounded on load); a refused update is still
  received to its end, so the trainer's broadcasts finish. Accepted tensors go through the
  model's own ``load_weights`` inside vLLM's layerwise reload (as vLLM's NCCL backend does), so
  the plugin's model reads every kept tensor back after the load.
- :class:`KeptTrainerWeightTransferEngine`: the trainer's side, called on every trainer rank
  (rank 0 sends, the others take part in the gathers), driving the four calls through any of
  vLLM's clients.
- :func:`register_backend`: both, in vLLM's factories of this process (idempotent).

Imports vLLM: imported only where vLLM is installed (its processes, a trainer that uses it).
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any, ClassVar, Self

import torch
import torch.nn as nn
from vllm.distributed.weight_transfer.base import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from fsdp_precision._base.devices import group_device
from fsdp_precision._base.dtypes import dtype_name
from fsdp_precision._engines.readback import raise_problems
from fsdp_precision._engines.transfer import (
    BUCKET_BYTES,
    WireMeta,
    receive_tensors,
    send_tensors,
    weight_group,
    wire_metas,
)
from fsdp_precision._engines.vllm.experts import repair_expert_updates
from fsdp_precision._engines.vllm.hold import fused_of, renamer_of

__all__ = [
    "BACKEND",
    "KeptInitInfo",
    "FSDPTrainerInitInfo",
    "KeptTrainerWeightTransferEngine",
    "KeptUpdateInfo",
    "KeptWeightTransferEngine",
    "refuse_update",
    "register_backend",
]

logger = logging.getLogger(__name__)

#: The name both sides register under in vLLM's factories (``WeightTransferConfig(backend=...)``).
BACKEND = "fsdp_precision_gloo"

_REFUSED = "fsdp-precision refused this weight update before loading any of it"
_FIX = (
    "Send every tensor in the dtype the engine holds it in: the kept ones as training kept "
    "them (FSDPWeightSource(model) sends each in the dtype training computed it in; not "
    "cast_kept=True), the rest in the engine's dtype; and start vLLM from an "
    "export_safetensors() directory, whose record makes the plugin hold kept tensors in their "
    "dtype"
)


@dataclass(kw_only=True)
class KeptInitInfo(WeightTransferInitInfo):  # type: ignore[misc]  # vLLM's base is untyped here
    """The worker's side of the handshake (``init_weight_transfer_engine``'s ``init_info``).

    A plain (not frozen) dataclass: vLLM's base class is one, and builds it from a dict.

    Attributes:
        master_address: Where the weight group's TCP store listens (the trainer's sender).
        master_port: Its port.
        rank_offset: This engine's first rank in the weight group (the sender is 0).
        world_size: The weight group's size: the sender and every worker of every engine.
        group_backend: ``"gloo"`` (CPU buffers) or ``"nccl"`` (GPU buffers). (Default: gloo)
        bucket_bytes: Bytes per bucket; the trainer sends its own. (Default: 256 MiB)
    """

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_backend: str = "gloo"
    bucket_bytes: int = BUCKET_BYTES


@dataclass
class KeptUpdateInfo(WeightTransferUpdateInfo):  # type: ignore[misc]  # vLLM's base is untyped here
    """One update (``update_weights``'s ``update_info``): the tensors in the order they are
    sent, as vLLM's NCCL backend names them.

    Attributes:
        names: Hugging Face checkpoint names.
        dtype_names: Each tensor's dtype on the wire (``"float32"``, ``"bfloat16"``).
        shapes: Each tensor's full shape.
    """

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]

    def __post_init__(self) -> None:
        self.metas = wire_metas(self.names, self.dtype_names, self.shapes)


def _rounds(sent: torch.dtype, held: torch.dtype) -> bool:
    """Whether loading a ``sent`` floating-point tensor into ``held`` can change its values."""
    if sent == held or not sent.is_floating_point:
        return False
    return not (held.is_floating_point and sent.itemsize < held.itemsize)


def refuse_update(model: nn.Module, metas: list[WireMeta], bulk: torch.dtype) -> None:
    """Raise :class:`~fsdp_precision.EngineDtypeError` naming each announced tensor the engine
    would not hold as sent: a kept one (the plugin's record) sent in another dtype than training
    kept it in, or any tensor sent wider than the engine's parameter (``bulk`` where the name
    maps to none of them: a shard of a fused tensor). Reads dtypes only; changes nothing."""
    held = getattr(model, "_fsdp_precision_held", None)
    kept: dict[str, torch.dtype] = dict(held.build.kept.tensors) if held is not None else {}
    params = dict(model.named_parameters(remove_duplicate=False))
    rename, fused = renamer_of(type(model)), fused_of(type(model))
    problems = []
    for meta in metas:
        want = kept.get(meta.name)
        if want is not None and meta.dtype != want:
            problems.append(
                f"{meta.name}: sent in {dtype_name(meta.dtype)}, training kept it in "
                f"{dtype_name(want)} (the engine holds it so)"
            )
            continue
        param = None if fused(meta.name) else params.get(rename(meta.name) or "")
        holds = param.dtype if param is not None else bulk
        if want is None and _rounds(meta.dtype, holds):
            problems.append(
                f"{meta.name}: sent in {dtype_name(meta.dtype)}, the engine holds it in "
                f"{dtype_name(holds)} and would round it"
            )
    raise_problems(problems, _REFUSED, _FIX)


class KeptWeightTransferEngine(WeightTransferEngine):  # type: ignore[misc]  # vLLM's, untyped here
    """vLLM's worker-side engine for :data:`BACKEND`: receives the library's buckets over a
    weight group of its own and loads them through the model's ``load_weights`` inside vLLM's
    layerwise reload (begun at the first accepted tensor, finished by
    ``finish_weight_update``). Each update is checked first (:func:`refuse_update`)."""

    init_info_cls = KeptInitInfo
    update_info_cls = KeptUpdateInfo
    supports_draft_weight_update = False  # the draft model holds nothing the plugin kept

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.group: Any = None
        self.bucket_bytes = BUCKET_BYTES
        self._reloading = False

    def init_transfer_engine(self, init_info: KeptInitInfo) -> None:
        """Join the weight group at ``rank_offset`` plus this worker's rank among all of the
        engine's workers (data-parallel replicas included)."""
        parallel = self.parallel_config
        worker = int(getattr(parallel, "data_parallel_index", 0) or 0) * int(
            parallel.world_size
        ) + int(parallel.rank)
        self.bucket_bytes = init_info.bucket_bytes
        self.group = weight_group(
            init_info.master_address,
            init_info.master_port,
            init_info.rank_offset + worker,
            init_info.world_size,
            backend=init_info.group_backend,
        )

    def start_weight_update(self) -> None:
        """Prepare an update: the expert layers' post-load processing is repaired for it
        (:func:`.experts.repair_expert_updates`); vLLM's layerwise reload begins only once a
        request is accepted, so a refused one leaves the model as it was."""
        repair_expert_updates(self.model)
        self._reloading = False

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """vLLM's, without its device synchronisation where no accelerator is present (the
        CPU build: ``torch.accelerator.synchronize`` raises there)."""
        self.receive_weights(self.parse_update_info(update_info))
        if torch.accelerator.is_available():
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: KeptUpdateInfo) -> None:
        """Receive one update into the model; whatever goes wrong (a refusal before anything
        loads, an error while loading, a kept tensor read back rounded), every broadcast of the
        update is taken part in before the error is raised: the trainer never waits."""
        if self.group is None:
            raise RuntimeError(
                f"the {BACKEND} weight transfer has no group; call init_weight_transfer_engine "
                "before update_weights"
            )
        from vllm.model_executor.model_loader.reload import (  # lazy: vLLM's loader, at use
            initialize_layerwise_reload,
        )

        received = receive_tensors(
            update_info.metas,
            self.group,
            src=0,
            device=group_device(self.group),
            bucket_bytes=self.bucket_bytes,
        )
        remaining = iter(received)
        try:
            refuse_update(self.model, update_info.metas, self.model_config.dtype)
            if not self._reloading:
                initialize_layerwise_reload(self.model)
                self._reloading = True
            self.model.load_weights(remaining)
        except BaseException:
            for _ in remaining:  # take part in every broadcast left, keep nothing
                pass
            self.finish_weight_update()  # what was loaded is processed, the rest put back
            raise

    def finish_weight_update(self) -> None:
        """Finish vLLM's layerwise reload, where an update began one."""
        if not self._reloading:
            return
        from vllm.model_executor.model_loader.reload import (  # lazy: vLLM's loader, at use
            finalize_layerwise_reload,
        )

        self._reloading = False
        finalize_layerwise_reload(self.model, self.model_config)

    def shutdown(self) -> None:
        """Leave the weight group."""
        self.group = None


@dataclass
class FSDPTrainerInitInfo(TrainerInitInfo):  # type: ignore[misc]  # vLLM's base is untyped here
    """The trainer's side of :data:`BACKEND`, for vLLM's
    ``WeightTransferTrainerFactory.trainer_init(info, client=..., source=...)``.

    Attributes:
        master_address: Where rank 0 (the sender) hosts the weight group's TCP store.
        master_port: Its port.
        world_size: The weight group's size: 1 (the sender) plus every engine worker.
        group_backend: ``"gloo"`` (CPU) or ``"nccl"`` (GPU). (Default: gloo)
        bucket_bytes: Bytes per bucket; sent to the workers at the handshake. (Default: 256 MiB)
        rank: This trainer process's rank (keyword): 0 sends, the others take part in the
            gathers.
    """

    backend: ClassVar[str] = BACKEND

    master_address: str
    master_port: int
    world_size: int
    group_backend: str = "gloo"
    bucket_bytes: int = BUCKET_BYTES


class KeptTrainerWeightTransferEngine(TrainerWeightTransferEngine):  # type: ignore[misc]
    """vLLM's trainer-side engine for :data:`BACKEND` (vLLM's base class is untyped here).

    ``send_weights()`` on every trainer rank: each iterates the source (its gathers are
    collective); rank 0 also drives ``start_weight_update``, ``update_weights`` (concurrently
    with its broadcasts) and ``finish_weight_update`` through the client. An update the engine
    refuses raises its error on rank 0 after the broadcasts finished; the other ranks return."""

    init_info_cls = FSDPTrainerInitInfo

    def __init__(
        self, *, client: Any, source: Any, is_sender: bool = True, bucket_bytes: int = BUCKET_BYTES
    ) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.bucket_bytes = bucket_bytes
        self.group: Any = None

    @classmethod
    def trainer_init(
        cls, init_info: FSDPTrainerInitInfo, *, client: Any, source: Any = None
    ) -> Self:
        """Open the weight group (rank 0) while the engine's workers join it through
        ``client.init_weight_transfer_engine``; the other ranks only build the engine."""
        if source is None:
            raise ValueError(
                f"the {BACKEND} trainer engine sends a WeightSource each round; pass "
                "source=FSDPWeightSource(model)"
            )
        engine = cls(
            client=client,
            source=source,
            is_sender=init_info.is_sender,
            bucket_bytes=init_info.bucket_bytes,
        )
        if not engine.is_sender:
            return engine
        worker_info = KeptInitInfo(
            master_address=init_info.master_address,
            master_port=init_info.master_port,
            rank_offset=1,
            world_size=init_info.world_size,
            group_backend=init_info.group_backend,
            bucket_bytes=init_info.bucket_bytes,
        )
        with ThreadPoolExecutor(max_workers=1) as pool:
            joined = pool.submit(client.init_weight_transfer_engine, asdict(worker_info))
            engine.group = weight_group(
                init_info.master_address,
                init_info.master_port,
                0,
                init_info.world_size,
                backend=init_info.group_backend,
            )
            joined.result()
        return engine

    def send_weights(self) -> None:
        """One full update, on every trainer rank."""
        source = self.source
        meta = source.metadata()  # every rank: a source may need all of them for it
        if not self.is_sender:
            for _ in source:  # take part in the gathers
                pass
            return
        info = KeptUpdateInfo(
            names=[m.name for m in meta],
            dtype_names=[dtype_name(m.dtype) for m in meta],
            shapes=[list(m.shape) for m in meta],
        )
        self.client.start_weight_update()
        pool = ThreadPoolExecutor(max_workers=1)
        try:
            received = pool.submit(
                self.client.update_weights,
                {"names": info.names, "dtype_names": info.dtype_names, "shapes": info.shapes},
            )
            if received.done():  # refused before any broadcast: say so instead of waiting
                received.result()
            send_tensors(info.metas, source, self.group, src=0, bucket_bytes=self.bucket_bytes)
            received.result()
        finally:
            pool.shutdown(wait=False)  # a broadcast that raised leaves the worker blocked
        self.client.finish_weight_update()

    def shutdown(self) -> None:
        """Leave the weight group."""
        self.group = None


def register_backend() -> None:
    """Register :data:`BACKEND` with vLLM's worker and trainer factories in this process
    (idempotent; a different engine already registered under the name is left, with a
    warning)."""
    from vllm.distributed.weight_transfer.factory import (  # lazy: vLLM's registries, at use
        WeightTransferEngineFactory,
        WeightTransferTrainerFactory,
    )

    for factory, cls in (
        (WeightTransferEngineFactory, KeptWeightTransferEngine),
        (WeightTransferTrainerFactory, KeptTrainerWeightTransferEngine),
    ):
        loader = getattr(factory, "_registry", {}).get(BACKEND)
        if loader is None:
            factory.register_engine(BACKEND, __name__, cls.__name__)
        elif loader() is not cls:
            logger.warning(
                "fsdp-precision: vLLM's %s already holds another %r engine (%s); left as it is",
                factory.__name__,
                BACKEND,
                loader(),
            )
