"""``MODEL``, resolved once: what ``plan``, ``verify`` and ``advise`` build and feed.

A ``MODEL`` argument is ``hf:<model_type>``, a Hugging Face directory (transformers' or
Diffusers' ``config.json``), or ``package.module:callable``. :func:`resolve` classifies it;
the :class:`ModelSpec` it returns reads the config (or imports the factory) on first use and
keeps it, and answers every question the commands ask of a ``MODEL``: the model built at full or
tiny size on a device (:meth:`~ModelSpec.build`, :meth:`~ModelSpec.build_tiny`), with its
weights (:meth:`~ModelSpec.with_weights`), and its forward inputs (:meth:`~ModelSpec.inputs`).

The library-specific pieces sit below it and never call back: transformers' configs and classes
(:mod:`~fsdp_precision._cli.models`), its inputs (:mod:`~fsdp_precision._cli.hf_inputs`), and
Diffusers' configs, classes and inputs (:mod:`~fsdp_precision._cli.diffusers_models`).
"""

from __future__ import annotations

import copy
import functools
import importlib
import inspect
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.nn as nn

from fsdp_precision._advise.usage import default_inputs
from fsdp_precision._cli import models
from fsdp_precision._cli.diffusers_models import DiffusersConfig, build, diffusers_config
from fsdp_precision._cli.diffusers_models import inputs_source as diffusers_inputs
from fsdp_precision._cli.diffusers_models import model_class as diffusers_class
from fsdp_precision._cli.hf_inputs import NEEDS, adds_to, transformers_inputs
from fsdp_precision._hf.declarations import library_of

__all__ = ["InputMaker", "ModelSpec", "own_or", "resolve"]

#: Makes one batch of forward keyword arguments from a generator (the same on every rank).
InputMaker = Callable[[torch.Generator], Any]


def resolve(text: str) -> ModelSpec:
    """The ``MODEL`` argument ``text``, classified (nothing is read or imported yet)."""
    return ModelSpec(text)


@dataclass(frozen=True)
class ModelSpec:
    """One ``MODEL`` argument.

    Attributes:
        text: The argument as given (every message names it).
    """

    text: str

    # ------------------------------------------------------------------ what it is

    @property
    def is_hf(self) -> bool:
        """``hf:<model_type>``, or a directory (a transformers or Diffusers config)."""
        return self.text.startswith("hf:") or Path(self.text).is_dir()

    @functools.cached_property
    def config(self) -> Any:
        """The transformers config, or a :class:`DiffusersConfig` for a Diffusers model
        directory (``_class_name`` in its config.json); read once. ``ValueError`` naming the
        fix when it cannot be read."""
        if not self.text.startswith("hf:"):
            diffusers = diffusers_config(self.text)
            if diffusers is not None:
                return diffusers
        return models.load_config(self.text)

    @functools.cached_property
    def _factory(self) -> tuple[ModuleType, Callable[[], Any]]:
        """The module and the callable of ``module:callable``; imported once."""
        module_name, sep, attr = self.text.partition(":")
        if not sep or not module_name or not attr:
            raise ValueError(
                f"MODEL {self.text!r} is not hf:<model_type>, a directory with config.json, or "
                "module:callable"
            )
        if not {"", os.getcwd()} & set(sys.path):  # the current directory's modules, as python -m
            sys.path.insert(0, os.getcwd())
        try:
            module = importlib.import_module(module_name)
            factory = getattr(module, attr)
        except (ImportError, AttributeError) as exc:
            raise ValueError(
                f"MODEL {self.text!r}: cannot import {attr} from {module_name} ({exc})"
            ) from exc
        if not callable(factory):
            raise ValueError(
                f"MODEL {self.text!r}: {module_name}.{attr} is a {type(factory).__name__}, not a "
                "callable; pass module:factory, a function or class that returns an nn.Module"
            )
        return module, factory

    # ------------------------------------------------------------------ building

    def build(
        self,
        device: str | torch.device = "meta",
        *,
        tiny: bool = False,
        dtype: torch.dtype | None = None,
    ) -> nn.Module:
        """The model under ``device`` (default meta: no memory, no initialisation).

        ``tiny``: a transformers config shrunk by :func:`fsdp_precision.testing.tiny_config`
        first (a Diffusers one by ``tiny_diffusers_config``); ignored for ``module:callable``.
        ``dtype``: floating dtype for a transformers model (``from_config(dtype=...)``) or a
        Diffusers one (cast after building); ``None`` keeps the config's; ignored for
        ``module:callable``. Raises ``ValueError`` with a one-line message for anything the
        user got wrong.
        """
        if self.is_hf:
            config = copy.deepcopy(self.config)  # a build never changes what the next reads
            if isinstance(config, DiffusersConfig):
                return build(config, torch.device(device), tiny=tiny, dtype=dtype)
            if tiny:
                config = models.tiny_config(config)
            return models._from_config(config, torch.device(device), dtype)
        _, factory = self._factory
        with torch.device(device):
            model = factory()
        if not isinstance(model, nn.Module):
            raise ValueError(
                f"MODEL {self.text!r} returned {type(model).__name__}, not an nn.Module"
            )
        return model

    def build_tiny(
        self, device: str | torch.device = "cpu", dtype: torch.dtype | None = None
    ) -> nn.Module:
        """:meth:`build` with ``tiny=True``, counted on the meta device first: ``ValueError``
        when it is not tiny (over ``TINY_MAX_PARAMS`` parameters) rather than filling memory."""
        meta = self.build("meta", tiny=True, dtype=dtype)
        count = sum(p.numel() for p in meta.parameters())
        del meta
        if count > models.TINY_MAX_PARAMS:
            raise ValueError(
                f"MODEL {self.text!r}: its tiny config still has {count:,} parameters (over "
                f"{models.TINY_MAX_PARAMS:,}): sizes fsdp_precision.testing.tiny_config does "
                "not shrink"
            )
        return self.build(device, tiny=True, dtype=dtype)

    def with_weights(self) -> nn.Module:
        """The model with its weights, in float32: a saved transformers or Diffusers directory
        (its ``*.safetensors``, never pickles, never remote code), or what a
        ``module:callable`` factory returns, built on the CPU."""
        if not self.is_hf:
            return self.build("cpu")
        path = Path(self.text)
        if not path.is_dir():
            raise ValueError(
                f"MODEL {self.text!r} has no weights to measure: pass a directory written by "
                "save_pretrained (with *.safetensors), or drop --measure"
            )
        if not any(path.glob("*.safetensors")):
            raise ValueError(
                f"MODEL {self.text!r}: no *.safetensors weights in the directory; --measure "
                "reads safetensors only (save_pretrained(..., safe_serialization=True)), never "
                "pickles"
            )
        if isinstance(self.config, DiffusersConfig):
            cls: Any = diffusers_class(self.config)
            loaded: nn.Module = cls.from_pretrained(
                self.text, torch_dtype=torch.float32, use_safetensors=True
            )
            return loaded
        return models.from_pretrained(self.text, self.config)

    # ------------------------------------------------------------------ inputs

    def input_maker(self, model: nn.Module) -> InputMaker | None:
        """What makes ``model``'s inputs: ``model.example_inputs(generator)``, a module-level
        ``example_inputs(model, generator)`` next to a ``module:callable`` factory, the builder
        of a Diffusers model's class family, or ``None`` for a transformers model that takes
        ``input_ids``. Raises ``ValueError`` when there is none."""
        method = getattr(model, "example_inputs", None)
        if callable(method):
            return method  # type: ignore[no-any-return]
        if not self.is_hf:
            module, _ = self._factory
            function = getattr(module, "example_inputs", None)
            if callable(function):
                return lambda g: function(model, g)
        if library_of(model) == "diffusers":
            return diffusers_inputs(self.text, model)
        if library_of(model) == "transformers":
            takes_ids = "input_ids" in inspect.signature(model.forward).parameters
            if takes_ids or getattr(model.config, "model_type", None) in NEEDS:
                return None  # token ids, or the pixel inputs NEEDS names for its model type
            raise ValueError(
                f"MODEL {self.text!r}: {type(model).__name__}.forward takes no input_ids, so "
                "verify cannot make its inputs; wrap it in a module:callable factory whose model "
                "has example_inputs(generator) -> dict"
            )
        raise ValueError(
            f"MODEL {self.text!r}: verify cannot make inputs for {type(model).__name__}; give "
            "the model a method example_inputs(self, generator) -> dict of forward keyword "
            "arguments, or define example_inputs(model, generator) next to the factory (draw "
            "only from the generator: every rank must get the same inputs)"
        )

    def inputs(self, model: nn.Module, generator: torch.Generator) -> dict[str, Any]:
        """Forward keyword arguments for ``model`` (identical on every rank for one seed)."""
        maker = self.input_maker(model)
        if maker is not None:
            inputs = maker(generator)
            if not isinstance(inputs, dict):
                raise ValueError(
                    f"MODEL {self.text!r}: example_inputs returned {type(inputs).__name__}, not "
                    "a dict of forward keyword arguments"
                )
            return inputs
        return transformers_inputs(self.text, model, generator)

    def inputs_or_none(self, model: nn.Module, seed: int = 0) -> dict[str, Any] | None:
        """:meth:`inputs` of ``seed``, or ``None`` where it makes none (a traced forward then
        says it traced nothing, and the first forward why)."""
        try:
            return self.inputs(model, torch.Generator().manual_seed(seed))
        except ValueError:
            return None


def own_or(model: nn.Module, inputs: Any) -> Any:
    """``inputs`` for ``model``'s traced forwards, or ``None`` for its own ``dummy_inputs``
    (a transformers model's, unless ``inputs`` add pixel values, decoder inputs, ...)."""
    own = default_inputs(model)
    return None if own is not None and not adds_to(inputs, own[0]) else inputs
