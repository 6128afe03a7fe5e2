"""No policy of the library's applies nowhere.

``fully_shard`` takes a :class:`ParamDtypeMixedPrecisionPolicy` as the plain
``MixedPrecisionPolicy`` it subclasses: without the patch installed, its map, boundary casts and
uncast inputs apply nowhere, and the kept parameters compute in ``param_dtype`` without a word.
Torch reads the policy's fields and calls nothing of it, so the one moment the library sees such a
policy before ``fully_shard`` does is its construction. Hence:

- **Construction installs the patch** (:func:`arm`): a policy that asks for anything only the patch
  understands installs it, idempotently and behind the source-hash check; where the installed
  torch cannot take the patch, construction raises the patch's own error (which names what differs
  and the way out). A policy that asks for nothing is torch's path and installs nothing.
- **Unpickling is a construction** (``ParamDtypeMixedPrecisionPolicy.__reduce__``): a policy sent
  to a spawned process installs the patch there. A policy loaded only to be read (a Trainer's
  ``training_args.bin`` on another machine) loads on a torch that cannot take the patch, with a
  warning: it would apply nowhere there.
- **The library's own plans** build policies under :func:`planning`: the patch is installed where
  the torch takes it; where it does not, the plan is still built (to show, to fall back to the
  public-API layout), and its ``apply()`` raises.
- **A unit built under the patch stops by name without it**: the construction wrap gives every
  unit whose gathers and reductions need the patch a forward check (``_patch/construct.py``):
  after ``remove_param_dtype_map_patch`` its next forward raises ``PolicyNotAppliedError``.
  Removing the patch is asking for torch alone: a policy built before and passed to
  ``fully_shard`` after it is torch's plain policy (build it again, which installs the patch).

The installer is registered by :mod:`fsdp_precision._patch` (a layer above this one) when it is
imported, which importing ``fsdp_precision`` always does.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any

from fsdp_precision._base.errors import PatchIntegrityError, UnsupportedTorchError

__all__ = ["arm", "disarmed", "needs_patch", "planning", "register_installer", "unpickled"]

_installer: Callable[[], None] | None = None
#: "plan": built by the library's own planning; "pickle": rebuilt from a pickle; "off": torch
#: alone, for controls (:func:`disarmed`).
_mode: ContextVar[str] = ContextVar("fsdp_precision_arm_mode", default="")


def register_installer(install: Callable[[], None]) -> None:
    """The function that installs the patch (``apply_param_dtype_map_patch``)."""
    global _installer
    _installer = install


def needs_patch(policy: Any) -> bool:
    """Whether ``policy`` asks for anything only the patch understands: a map, boundary casts
    or inputs left uncast."""
    return bool(
        getattr(policy, "param_dtype_map", None)
        or getattr(policy, "module_casts", None)
        or getattr(policy, "uncast_inputs", None)
    )


def arm(policy: Any) -> None:
    """Install the patch for a newly built ``policy`` that needs it."""
    if not needs_patch(policy) or _mode.get() == "off":
        return
    assert _installer is not None, "fsdp_precision._patch registers the installer on import"
    try:
        _installer()
    except (UnsupportedTorchError, PatchIntegrityError) as exc:
        mode = _mode.get()
        if mode == "plan":  # the plan's apply() raises the same error, after showing
            return
        if mode == "pickle":
            warnings.warn(
                f"fsdp_precision: loaded a ParamDtypeMixedPrecisionPolicy (map "
                f"{policy.param_dtype_map!r}) on a torch the patch cannot run on; passed to "
                f"fully_shard here it would apply nowhere ({exc})",
                RuntimeWarning,
                stacklevel=3,
            )
            return
        raise


@contextlib.contextmanager
def planning() -> Iterator[None]:
    """Build policies for a plan: on a torch the patch cannot run on they are built anyway."""
    with _in_mode("plan"):
        yield


@contextlib.contextmanager
def disarmed() -> Iterator[None]:
    """Policies built inside neither install the patch nor hold it: what torch alone does with
    them, for a control (the library's conformance runs compare against it)."""
    with _in_mode("off"):
        yield


@contextlib.contextmanager
def _in_mode(mode: str) -> Iterator[None]:
    token = _mode.set(mode)
    try:
        yield
    finally:
        _mode.reset(token)


def unpickled(cls: type[Any], fields: dict[str, Any]) -> Any:
    """A pickled policy, rebuilt through its constructor (which arms it)."""
    if _mode.get() == "off":
        return cls(**fields)
    with _in_mode("pickle"):
        return cls(**fields)
