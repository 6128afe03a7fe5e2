"""Routed experts on vLLM's CPU build: vLLM's own capture, driven on the model runner it runs.

vLLM returns the expert ids its MoE layers chose (``LLM(..., enable_return_routed_experts=True)``;
``CompletionOutput.routed_experts``: numpy ``[prompt + generated - 1, num_hidden_layers, top_k]``,
``uint8`` up to 256 experts, else ``uint16``; rows by absolute decoder-layer index, a dense
layer's rows zero) through its AuxOutput connector, whose worker side only Model Runner V2 runs:
``VllmConfig`` refuses the switch elsewhere ("AuxOutput Connector requires Model Runner V2"), and
V2 needs a Triton backend for the device, which the CPU build lacks. vLLM's scheduler side
(``AuxOutputSchedulerConnector``), its output path (``EngineCoreOutput.routed_experts`` ->
``CompletionOutput``), its capture (``RoutedExpertsCapturer``, bound to every MoE layer's router
by ``bind_routed_experts_capturer``: the ids out of the router's own ``select_experts``, before
any load-balancing remap) and its worker connector are device-agnostic. This module gives the CPU
build's V1 model runner the three calls V2 makes (connector built with the KV cache, each step
begun before the forward, each step's rows handed back with its output; closed at shutdown), and
lets ``VllmConfig`` accept the switch there (its other checks all run). Nothing is recomputed:
the rows are what vLLM's router selected, every router kind vLLM's ``BaseRouter`` covers
(softmax top-k, grouped top-k with a correction bias, custom routing functions), in vLLM's
format, by vLLM's code.

Acts only on the CPU platform, with the V1 model runner, where the switch is on; where V2 runs
(a GPU), vLLM's own capture is used untouched. Compiled (the CPU build's default), vLLM traces its
CPU router into the model's graph, where its capture callback would be lost: the callbacks go
through an op the graph keeps (:mod:`.capture`), bound before the warm-up traces the graph, and
the op keys vLLM's compile cache (:data:`CACHE_KEY`). Speculative decoding with routes is refused
(rejected drafts' rows are not dropped here).
Every vLLM function called with a stand-in or relied on for its layout is source-hashed
(:data:`SOURCES`), and the minor release is one of :data:`.archs.TESTED_VLLM`: otherwise nothing
is patched, and a request for routes is refused by name (:data:`UNAVAILABLE`) rather than
answered with ``None``.

Imports vLLM inside its functions only: :func:`install` runs from :func:`.plugin.register`.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from fsdp_precision._base.sources import check_sources, lookup
from fsdp_precision._engines.vllm import capture
from fsdp_precision._engines.vllm.archs import UNTESTED_ENV, tested

__all__ = ["CACHE_KEY", "SOURCES", "UNAVAILABLE", "install", "installed"]

logger = logging.getLogger(__name__)

_CONFIG = "vllm.config.vllm:VllmConfig._verify_aux_output_compatibility"
_RUNNER = "vllm.v1.worker.cpu_model_runner:CPUModelRunner"

#: vLLM 0.32's functions the capture calls with a stand-in or relies on for their layout
#: (``"module:qualname"`` -> sha256 of the source, :mod:`fsdp_precision._base.sources`).
SOURCES: dict[str, str] = {
    # called with a view of the config that reports V2 (its other checks all run)
    _CONFIG: "e64828e79c38c4aefb0cad64551b63e75a88562ee9cf59c66eccd28bf9a876da",
    # reads only ``req_ids``, ``query_start_loc_np`` and ``num_computed_tokens_np`` of its batch
    "vllm.distributed.aux_output_connector.worker:AuxOutputWorkerConnector.prepare_output": (
        "a775b8cca5dc2713561217d4daa85b74f7f35fce1036eb68b3ebdbb9e6d0887d"
    ),
    # on CPU its "device" copy is the snapshot itself
    "vllm.distributed.aux_output_connector.worker:PendingAuxOutput.enqueue_cpu_copy": (
        "49b887e1253d8afa6d039bb65dbf1e5bda0a5275b14ea9eb4dbeaaa0c1226d74"
    ),
    # its capturer (``_capturer``) is the one the op hands each step's ids to
    "vllm.distributed.aux_output_connector.worker:AuxOutputWorkerConnector.__init__": (
        "2c471ba2e608bd4ccaaa65bca79969ebaba80ecb921d1929e06b6f1c8913b923"
    ),
    # the routers it binds are the ones :func:`.capture.bind` binds
    "vllm.model_executor.layers.fused_moe.routed_experts_capturer:bind_routed_experts_capturer": (
        "8e00209b2fbb9eda6530b357b19c8464b0d8000877351421bcb72f95f6d82a6c"
    ),
    # calls ``capture_fn`` with the router's logical ids, before any load-balancing remap
    "vllm.model_executor.layers.fused_moe.router.base_router:BaseRouter._select_experts": (
        "116bab6917a85a1080aee757d35a696b1863979ac7737debea61cdb6bc1c9177"
    ),
    # wrapped: the connector is built after it, as V2 builds it after its KV cache
    f"{_RUNNER}.initialize_kv_cache": (
        "0f18d097f7cb4e029e93a9be32d50d3d1bcba85829ef4da95928c4efcc1ee241"
    ),
    # wrapped: the routers call the op from the model's build on, before the warm-up traces it
    f"{_RUNNER}.load_model": "8cde22d6a33ff9d3afbf32a1cd1d71de59bb2aff81428081915b32fdf61d8ba5",
}

#: Why the capture is not installed in this process (empty where it is, or where it is not
#: needed): a request for routes on the CPU build's V1 runner is refused with these reasons.
UNAVAILABLE: list[str] = []

#: The key of vLLM's ``additional_config`` that keys its compile cache by the capture's op.
CACHE_KEY = "fsdp_precision_routes"

_ORIGINALS: dict[str, Any] = {}  # "module:Class.attr" -> vLLM's own (None where inherited)
_CONNECTOR = "_fsdp_precision_routes"  # the runner's AuxOutputWorkerConnector
_PENDING = "_fsdp_precision_routes_pending"  # one step's rows, between forward and sampling


def installed() -> bool:
    """Whether this process's CPU model runner captures routed experts where asked."""
    return any(target.startswith(_RUNNER) for target in _ORIGINALS)


@dataclass(frozen=True)
class _Batch:
    """The three fields of V2's ``InputBatch`` that ``AuxOutputWorkerConnector.prepare_output``
    reads, from the V1 runner's step."""

    req_ids: list[str]
    query_start_loc_np: np.ndarray
    num_computed_tokens_np: np.ndarray


class _AsV2:
    """The config as V2 would present it, for vLLM's own compatibility check (which then runs
    every check but the runner's: generate runner, MoE model, prefix caching, speculation)."""

    use_v2_model_runner = True

    def __init__(self, config: Any) -> None:
        self._config = config

    def __getattr__(self, name: str) -> Any:
        return getattr(self._config, name)


def _verify(original: Any) -> Any:
    @functools.wraps(original)
    def verify(self: Any) -> None:
        from vllm.platforms import current_platform  # lazy: vLLM's platform

        if (
            not self.aux_output_config.enabled
            or self.use_v2_model_runner
            or not current_platform.is_cpu()
        ):
            return original(self)  # type: ignore[no-any-return]
        if UNAVAILABLE:
            raise ValueError(
                "enable_return_routed_experts: vLLM's CPU build runs its V1 model runner, where "
                "vLLM does not capture routed experts, and fsdp-precision's capture for it is "
                f"not installed in this vLLM ({'; '.join(UNAVAILABLE)}). Use a vLLM release "
                "the integration was run against (fsdp_precision.integrations.vllm."
                "TESTED_VLLM), or serve without enable_return_routed_experts"
            )
        if self.speculative_config is not None:
            raise ValueError(
                "enable_return_routed_experts with speculative decoding "
                f"({self.speculative_config.method!r}) on vLLM's CPU build: fsdp-precision's "
                "capture for its V1 model runner keeps every scheduled token's row and cannot "
                "drop rejected drafts. Serve without speculative_config to get routes"
            )
        if isinstance(self.additional_config, dict):
            # vLLM hashes this dict into its compile-cache key: a graph traced without the
            # capture's op (the switch off, or another build) is never loaded for one with it
            self.additional_config[CACHE_KEY] = capture.OP
        return original(_AsV2(self))  # type: ignore[no-any-return]

    return verify


def _initialize_kv_cache(original: Any) -> Any:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def initialize_kv_cache(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        bound = signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        if bound.arguments["is_profiling"] or not self.vllm_config.aux_output_config.enabled:
            return result
        from vllm.distributed.aux_output_connector.worker import (  # lazy: vLLM's
            get_aux_output_connector,
        )

        previous = getattr(self, _CONNECTOR, None)
        if previous is not None:
            previous.close()
        connector = get_aux_output_connector(
            self.get_model(), self.vllm_config, bound.arguments["kv_cache_config"]
        )
        capture.bind(self.get_model())  # vLLM's callbacks, through an op a graph keeps
        setattr(self, _CONNECTOR, connector)
        setattr(self, _PENDING, None)
        logger.info(
            "fsdp-precision: vLLM's routed-experts capture bound to its CPU V1 model runner "
            "(enable_return_routed_experts): CompletionOutput.routed_experts is filled"
        )
        return result

    return initialize_kv_cache


def _load_model(original: Any) -> Any:
    @functools.wraps(original)
    def load_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        if self.vllm_config.aux_output_config.enabled:
            capture.bind(self.get_model())  # before the warm-up traces the graph
        return result

    return load_model


def _execute_model(original: Any) -> Any:
    @functools.wraps(original)
    def execute_model(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        connector = getattr(self, _CONNECTOR, None)
        if connector is None:
            return original(self, scheduler_output, *args, **kwargs)
        # V2: the step's requests and block hashes registered before the forward
        connector.begin_step(scheduler_output.aux_output_connector_metadata)
        setattr(self, _PENDING, None)
        with capture.stepping(connector._capturer):
            result = original(self, scheduler_output, *args, **kwargs)
        if self.execute_model_state is None:
            return result  # no forward ran: no request emits a token this step
        n = self.input_batch.num_reqs
        batch = _Batch(
            req_ids=list(self.input_batch.req_ids[:n]),
            query_start_loc_np=self.query_start_loc.np[: n + 1].copy(),
            num_computed_tokens_np=self.input_batch.num_computed_tokens_cpu[:n].copy(),
        )
        pending = connector.prepare_output(batch)  # snapshots the capture buffer's rows
        if pending is not None:  # None on TP ranks that do not own the output
            # a request sampled this step unless it is a prefill's earlier chunk
            sampled = (~self.discard_request_mask.np[:n].astype(bool)).astype(np.int32)
            setattr(self, _PENDING, (pending, sampled))
        return result

    return execute_model


def _attach(pending: Any, sampled: np.ndarray, output: Any) -> Any:
    """vLLM's step output with the step's rows, as V2's ``AsyncOutput`` hands them over."""
    pending.enqueue_cpu_copy(sampled, np.zeros_like(sampled))  # no drafts: none rejected
    output.aux_output_connector_output = pending.process_output()
    return output


def _sample_tokens(original: Any) -> Any:
    @functools.wraps(original)
    def sample_tokens(self: Any, *args: Any, **kwargs: Any) -> Any:
        output = original(self, *args, **kwargs)
        step: tuple[Any, np.ndarray] | None = getattr(self, _PENDING, None)
        if step is None:
            return output
        setattr(self, _PENDING, None)
        pending, sampled = step
        from vllm.v1.outputs import AsyncModelRunnerOutput  # lazy: vLLM's

        if isinstance(output, AsyncModelRunnerOutput):  # not on CPU (no async scheduling)
            get_output = output.get_output
            output.get_output = lambda: _attach(pending, sampled, get_output())
            return output
        return _attach(pending, sampled, output)

    return sample_tokens


def _shutdown(original: Any) -> Any:
    @functools.wraps(original)
    def shutdown(self: Any, *args: Any, **kwargs: Any) -> Any:
        connector = getattr(self, _CONNECTOR, None)
        if connector is not None:
            setattr(self, _CONNECTOR, None)
            connector.close()
        return original(self, *args, **kwargs)

    return shutdown


_WRAPPERS = {
    "load_model": _load_model,
    "initialize_kv_cache": _initialize_kv_cache,
    "execute_model": _execute_model,
    "sample_tokens": _sample_tokens,
    "shutdown": _shutdown,
}


def _unchecked() -> list[str]:
    """Why this vLLM is not the one the capture was written for (empty where it is)."""
    import vllm  # lazy: the engine

    reasons = []
    version = str(vllm.__version__)
    if not tested(version) and os.environ.get(UNTESTED_ENV) != "1":
        reasons.append(
            f"vLLM {version} is outside the releases it was run against ({UNTESTED_ENV}=1 "
            "tries it: the sources it relies on are still checked)"
        )
    changed = {t: why for t, why in check_sources(SOURCES).items() if why is not None}
    if changed:
        reasons.append(
            "vLLM's code it relies on changed: "
            + ", ".join(f"{t} ({why})" for t, why in sorted(changed.items()))
        )
    return reasons


def _patch(target: str, wrap: Any) -> None:
    owner, _, name = target.rpartition(".")
    cls = lookup(owner)
    _ORIGINALS[target] = cls.__dict__.get(name)  # None where inherited
    setattr(cls, name, wrap(getattr(cls, name)))


def _undo(targets: list[str]) -> None:
    for target in targets:
        owner, _, name = target.rpartition(".")
        original = _ORIGINALS.pop(target)
        if original is None:
            delattr(lookup(owner), name)
        else:
            setattr(lookup(owner), name, original)


def install() -> None:
    """Let vLLM's CPU build return routed experts through its V1 model runner (idempotent;
    never raises: where it cannot, the runner is left as vLLM's and :data:`UNAVAILABLE` says
    why, which a request for routes then names)."""
    if _ORIGINALS or UNAVAILABLE:
        return
    runner: list[str] = []
    try:
        from vllm.platforms import current_platform  # lazy: vLLM's platform

        if not current_platform.is_cpu():
            return  # a GPU runs V2, whose capture is vLLM's own
        reasons = _unchecked()
        if not any(_CONFIG in reason for reason in reasons):
            _patch(_CONFIG, _verify)  # refuses by name while UNAVAILABLE lists a reason
        if reasons:
            raise RuntimeError("; ".join(reasons))
        capture.define()  # before any graph that calls it is compiled or loaded
        for name, wrap in _WRAPPERS.items():
            runner.append(f"{_RUNNER}.{name}")
            _patch(runner[-1], wrap)
    except Exception as err:  # noqa: BLE001 - vLLM does not catch what a plugin raises
        UNAVAILABLE.append(f"{type(err).__name__}: {err}")
        try:
            _undo([target for target in runner if target in _ORIGINALS])
        finally:
            logger.warning(
                "fsdp-precision: vLLM's routed-experts capture is not available on this CPU "
                "build (%s); enable_return_routed_experts is refused, all else is unaffected",
                UNAVAILABLE[-1],
            )
