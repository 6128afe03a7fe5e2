"""The plan: the planned ``fully_shard`` calls of one model, and what can be done with them.

:func:`fsdp_precision.compile_param_dtype_maps` builds it once, complete. Its data and what is
read from it live in :mod:`~fsdp_precision._plan.data`, below the modules that check it before
the first call (``preflight``), lay it out on meshes (``meshes``) and report it (``report``);
:class:`PrecisionPlan` adds those verbs, and applying it, as methods that delegate to them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import torch.nn as nn
from torch.distributed.fsdp import fully_shard

from fsdp_precision._hf.recording import keep_output_recording
from fsdp_precision._patch import apply_param_dtype_map_patch
from fsdp_precision._plan import meshes as meshes_mod
from fsdp_precision._plan import preflight, report
from fsdp_precision._plan.data import PlanData
from fsdp_precision._plan.diagnose import computes_kept, install_plan_diagnosis
from fsdp_precision._plan.meshes import Meshes
from fsdp_precision._plan.records import PlannedUnit
from fsdp_precision._plan.replicated import average_gradients
from fsdp_precision._plan.upcast import upcast_storage
from fsdp_precision._policy.inputs import install_input_cast
from fsdp_precision._policy.policy import ParamDtypeMixedPrecisionPolicy
from fsdp_precision._releases.status import patch_status

__all__ = ["PrecisionPlan"]


@dataclass(frozen=True)
class PrecisionPlan(PlanData):
    """The compiled plan: units in ``fully_shard`` order (innermost first, root last).

    Attributes:
        model: The planned model.
        rules: The rules it was compiled from.
        units: The planned ``fully_shard`` calls, in order.
        declarations: The model's keep-in-fp32 declarations that applied.
        claims: Per rule, in precedence order, what it claimed.
        world_size: Shards per unit (the shard dimension of the mesh). (Default: ``1``)
        reshard_after_forward: The ``fully_shard`` knob the counts assume and :meth:`apply`
            passes. (Default: ``None``, torch's: every unit but the root)
        hsdp: Units are sharded on a 2-D (replicate, shard) mesh. (Default: ``False``)
        replicated: 0-dim parameters, in no unit: replicated on every rank, computing in their
            storage dtype, gradients averaged after backward. (Default: ``()``)
        unit_choice: How the units were chosen and which selected modules were refused
            (``plan_model_for_training``). (Default: ``None``, units given by the caller)
        found_advice: What the precision advisor found when the plan was compiled with
            ``advice="apply"``. (Default: ``None``: traced when :attr:`advice` is first read)
        fallback: Why the plan is the public-API layout although another was asked for
            (``unknown_torch="public_api"`` on a torch the patch cannot run on), and what it
            costs. (Default: ``None``)
        layout: Where its kept parameters go: ``"in_unit"`` (inside their units, exact maps)
            or ``"separate_units"`` (each module holding them its own unit, plain policies).
            (Default: ``"in_unit"``)
    """

    # ----------------------------------------------------------------- applying

    def apply(self, **fully_shard_kwargs: Any) -> nn.Module:
        """Make the planned ``fully_shard`` calls in order; return the model.

        Applies the patch first when a unit has a non-empty map or casts, and wherever else
        the installed torch allows it (not on a :attr:`fallback` plan): its reduce takes the
        mixed gradient dtypes that torch's asserts on (pytorch #196996), in units that keep
        nothing too (the separate-units layout's included). ``fully_shard_kwargs`` (mesh,
        offload_policy, ...) go to every call, with the plan's ``reshard_after_forward`` and
        the :attr:`replicated` parameters added to ``ignored_params``; those get their
        gradients averaged over the mesh. Parameters a user rule keeps wider than they are
        stored (:attr:`upcasts`) are upcast exactly first. Before the first call, every call is
        checked as the
        installed release's ``fully_shard`` would check it (:meth:`check`), so a refused plan
        leaves the model untouched. Raises ``ValueError`` before any call when the kwargs
        contradict the knobs the plan was compiled with (``reshard_after_forward``, a 2-D mesh
        for ``hsdp``): its counts would be wrong.
        """
        kwargs = self.knobs.checked_kwargs(fully_shard_kwargs)
        scalars = [self.model.get_parameter(p.fqn) for p in self.replicated]
        if scalars:
            kwargs["ignored_params"] = set(kwargs.get("ignored_params") or ()) | set(scalars)
        self._install_patch()
        undo = upcast_storage(self.model, self.upcasts)
        try:
            self.check(ignored_params=kwargs.get("ignored_params"))
        except BaseException:
            undo()  # a refused plan leaves the model as it found it
            raise
        for unit in self.units:
            target = unit.modules[0] if len(unit.modules) == 1 else list(unit.modules)
            fully_shard(target, mp_policy=unit.policy, **kwargs)
            _cast_inputs_of_plain_unit(unit)
        average_gradients(scalars, kwargs.get("mesh"))
        if self.layout == "separate_units":  # no map names a kept module: the same notes
            install_plan_diagnosis(self.model, self, kept=computes_kept(self))
        # Mapped units had it done by their construction step; the others are plain calls.
        keep_output_recording([m for u in self.units if not u.param_dtype_map for m in u.modules])
        return self.model

    def _install_patch(self) -> None:
        if any(u.param_dtype_map or u.module_casts or _policy_uncast(u) for u in self.units):
            apply_param_dtype_map_patch()  # needed: raises where the torch cannot take it
        elif self.fallback is None and patch_status().usable:
            apply_param_dtype_map_patch()  # for the reduce alone (contract point 3)

    def check(self, *, ignored_params: Any = None) -> None:
        """Raise what any planned ``fully_shard`` call would refuse, before any is made.

        Per call: the map against the parameters it will manage (``ParamDtypeMapError``), the
        installed release's own refusals (2.11's non-floating parameters, ...), and
        parameters that are already sharded (``ValueError``: the model was wrapped before).
        """
        preflight.check_plan(self, ignored_params or set())

    # ----------------------------------------------------------------- reporting

    def alternatives(self) -> dict[str, dict[str, Any]]:
        """The same model under a uniform policy and under separate units."""
        return report.alternatives(self)

    def mesh_totals(self, meshes: Meshes) -> dict[str, Any]:
        """Per pipeline stage, per rank and step, with tensor, expert and pipeline parallelism
        beside FSDP (``world_size`` its degree), laid out from the model's own declared plans:
        units, all-gathers, reduce-scatters, bytes all-gathered, and the TP gradient
        all-reduces with their bytes in the reduce and in the compute dtype. ``ValueError``
        where the model declares no plan for a degree above 1."""
        return meshes_mod.mesh_totals(self, meshes)

    def to_dict(self, *, meshes: Meshes | None = None) -> dict[str, Any]:
        """JSON-ready form of the plan (``json.dumps(plan.to_dict())``); with ``meshes``, their
        :meth:`mesh_totals` under ``"meshes"``."""
        return report.to_dict(self, meshes=meshes)

    def to_json(self, *, meshes: Meshes | None = None, **kwargs: Any) -> str:
        """``json.dumps(self.to_dict(meshes=meshes), **kwargs)``."""
        return json.dumps(self.to_dict(meshes=meshes), **kwargs)

    def explain(self, *, max_params: int = 12, meshes: Meshes | None = None) -> str:
        """A human table: per unit, who claimed what, bytes per all-gather, collectives; with
        ``meshes`` (TP, EP, PP beside FSDP), per stage and rank (:meth:`mesh_totals`)."""
        return report.explain(self, max_params=max_params, meshes=meshes)


def _policy_uncast(unit: PlannedUnit) -> bool:
    """Whether the unit's own policy leaves inputs uncast (its construction installs the cast)."""
    return isinstance(unit.policy, ParamDtypeMixedPrecisionPolicy) and bool(
        unit.policy.uncast_inputs
    )


def _cast_inputs_of_plain_unit(unit: PlannedUnit) -> None:
    """A plain policy's unit with inputs left uncast (the separate-units layout): its policy
    casts none, the cast that leaves them out goes on each module."""
    dtype = unit.policy.param_dtype
    if unit.uncast_inputs and not _policy_uncast(unit) and dtype is not None:
        for module in unit.modules:
            install_input_cast(module, dtype, unit.uncast_inputs)
