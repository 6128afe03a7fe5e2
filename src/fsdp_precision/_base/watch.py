"""Watching a forward: which module forwards are running, and which watched tensors each torch
function touches. The usage analysis that chooses units and the runtime guard that names a
module used outside its unit both watch forwards this way."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn as nn
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

__all__ = ["ROOT", "ParamWatch", "RunningModules", "attribute_read"]

#: How the root module is named where a module FQN is shown (its FQN is ``""``).
ROOT = "<root>"


def attribute_read(func: Callable[..., Any]) -> str | None:
    """The attribute a torch function reads (``"dtype"`` for ``Tensor.dtype``), None for ops."""
    if getattr(func, "__name__", "") != "__get__":
        return None
    return str(getattr(getattr(func, "__self__", None), "__name__", "?"))


class ParamWatch(TorchFunctionMode):
    """Calls :meth:`touched` for every watched tensor (by ``id``) a torch function receives:
    ops and attribute reads (``.dtype``) alike."""

    def __init__(self, watched: Mapping[int, Any]) -> None:
        super().__init__()
        self.watched = watched

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        for leaf in pytree.tree_leaves((args, kwargs)):
            if isinstance(leaf, torch.Tensor) and id(leaf) in self.watched:
                self.touched(func, leaf)
        return func(*args, **kwargs)

    def touched(self, func: Callable[..., Any], tensor: torch.Tensor) -> None:
        """One watched tensor reached ``func``."""
        raise NotImplementedError


class RunningModules:
    """While entered, :attr:`stack` holds the FQNs of the modules of one model whose forward is
    running, innermost last (global module hooks; a forward that raises is popped too).

    >>> with RunningModules(model) as running:  # doctest: +SKIP
    ...     model(x)  # inside a forward, running.innermost names the module
    """

    def __init__(self, model: nn.Module) -> None:
        #: ``id(module) -> FQN`` (:data:`ROOT` for the root).
        self.names: dict[int, str] = {id(m): (n or ROOT) for n, m in model.named_modules()}
        #: FQNs of the running forwards, outermost first.
        self.stack: list[str] = []
        self._handles: list[Any] = []

    @property
    def innermost(self) -> str:
        """The FQN of the innermost running forward (:data:`ROOT` when none runs)."""
        return self.stack[-1] if self.stack else ROOT

    def _pre(self, module: nn.Module, args: Any) -> None:
        if id(module) in self.names:
            self.stack.append(self.names[id(module)])

    def _post(self, module: nn.Module, args: Any, output: Any) -> None:
        name = self.names.get(id(module))
        if name is not None and self.stack and self.stack[-1] == name:
            self.stack.pop()

    def __enter__(self) -> RunningModules:
        self._handles = [
            register_module_forward_pre_hook(self._pre),
            register_module_forward_hook(self._post, always_call=True),
        ]
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
