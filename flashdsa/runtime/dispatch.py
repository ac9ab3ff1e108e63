"""Backend registry and selection shared by the kernel, indexer and cache ops.

Each op registers one implementation per backend as a lazy ``"module:function"`` target, so
importing flashdsa never imports Triton or builds CUDA code. ``select`` picks the fastest
backend that can serve the call: a forced backend (argument or ``FLASHDSA_BACKEND``) that
cannot serve raises ``ValueError`` with its reason; an automatic choice that falls back to a
slower backend logs the reason once. A backend may also decline a call it could run (``Declined``:
another is faster at that shape); that is a choice, not a fallback, so nothing is logged.

On CUDA devices choices are remembered per op, device, backend argument, ``FLASHDSA_BACKEND`` and
facts, so a repeated call pays a dict lookup instead of every backend's device, support and import
checks (microseconds of host time ahead of each kernel). What else decides is fixed for a process:
a device's capability, the native toolchain, whether a target imports (a failed native build stays
failed, ``native.load``). ``register`` forgets every choice; an op whose support check reads state
that changes (``register(..., stable=False)``) is never remembered.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
from dataclasses import dataclass
from typing import Callable, Optional

import torch

logger = logging.getLogger(__name__)

BACKENDS = ("cuda", "cublas", "triton", "reference")  # fastest first
ENV_VAR = "FLASHDSA_BACKEND"

# A support check gets the call's keyword "shape facts" and returns None or why it cannot serve.
SupportCheck = Callable[..., Optional[str]]


class Declined(str):
    """A support check's answer when the backend could serve the call but another is faster at this
    shape: automatic selection moves on without logging; a forced backend runs anyway."""


@dataclass(frozen=True)
class Impl:
    target: str  # "package.module:function", imported on first use
    supports: Optional[SupportCheck] = None
    stable: bool = True  # supports answers from its facts and what is fixed for a process


_REGISTRY: dict[str, dict[str, Impl]] = {}
_warned: set[tuple[str, str]] = set()
_choices: dict[tuple, str] = {}  # choose's key -> backend name, for ops whose backends are all stable
MAX_CHOICES = 4096  # facts such as M vary per call: past this many the remembered choices start afresh


def register(op: str, backend: str, target: str, supports: Optional[SupportCheck] = None, *,
             stable: bool = True) -> None:
    """Register ``target`` as the ``backend`` implementation of ``op``. ``stable=False``: ``supports``
    reads state that changes while the process runs, so choices for ``op`` are made afresh each call."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    _REGISTRY.setdefault(op, {})[backend] = Impl(target, supports, stable)
    _choices.clear()


@functools.cache
def _load(target: str) -> Callable:
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


def interpreting() -> bool:
    """True when Triton kernels run in the interpreter (TRITON_INTERPRET=1), e.g. in CPU CI."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _device_reason(backend: str, device: torch.device) -> Optional[str]:
    if backend == "reference":
        return None
    if backend == "triton" and interpreting():
        return None
    if device.type != "cuda":
        return f"{backend} needs a CUDA device, got {device}"
    if backend == "cuda" and torch.cuda.get_device_capability(device) != (9, 0):
        return "cuda backend holds Hopper (SM90) kernels only"
    return None


def _unavailable(op: str, backend: str, device: torch.device, facts: dict) -> Optional[str]:
    impl = _REGISTRY.get(op, {}).get(backend)
    if impl is None:
        return f"{op} has no {backend} implementation"
    reason = _device_reason(backend, device)
    if reason is None and impl.supports is not None:
        reason = impl.supports(**facts)
    if reason is None:
        try:
            _load(impl.target)
        except ImportError as e:  # e.g. triton not installed
            reason = f"cannot import {impl.target}: {e}"
    return reason


def choose(op: str, device: torch.device, backend: Optional[str] = None, **facts) -> str:
    """The name of the backend that runs ``op`` on ``device``.

    backend: None picks automatically; ``FLASHDSA_BACKEND`` forces one for every op that has it
    (``cuda`` forces the native kernels that exist while the other ops keep choosing).
    facts: keyword shape facts handed to each backend's support check (e.g. ``h_q=128``).
    """
    return _remembered(op, device, backend, facts)


def _remembered(op: str, device: torch.device, backend: Optional[str], facts: dict) -> str:
    """:func:`_choose`'s answer, remembered on CUDA devices for stable ops (a failure, which raises,
    never is). Off CUDA devices (the reference backend, Triton's interpreter) the choice also hangs on
    ``TRITON_INTERPRET`` and host time hardly counts, so it is made afresh there."""
    if device.type != "cuda":
        return _choose(op, device, backend, facts)
    environment = os.environ.get(ENV_VAR) if backend is None else None  # an argument overrides it
    key = (op, device, backend, environment, *facts.items())
    try:
        return _choices[key]
    except KeyError:
        pass
    except TypeError:  # an unhashable fact: nothing to remember it by
        return _choose(op, device, backend, facts)
    name = _choose(op, device, backend, facts)
    if all(impl.stable for impl in _REGISTRY[op].values()):
        if len(_choices) >= MAX_CHOICES:
            _choices.clear()
        _choices[key] = name
    return name


def _choose(op: str, device: torch.device, backend: Optional[str], facts: dict) -> str:
    """:func:`choose` without remembering: asks each backend in turn."""
    forced = backend
    if forced is None:
        forced = _environment_backend(op)
    if forced is not None:
        if forced not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {forced!r}")
        reason = _unavailable(op, forced, device, facts)
        if reason is not None and not isinstance(reason, Declined):
            raise ValueError(f"backend {forced!r} cannot run {op}: {reason}")
        return forced
    reasons = []
    for name in BACKENDS:
        reason = _unavailable(op, name, device, facts)
        if reason is None:
            if reasons and device.type == "cuda" and (op, name) not in _warned:
                _warned.add((op, name))
                logger.warning("%s falls back to %s on %s: %s", op, name, device, "; ".join(reasons))
            return name
        if name in _REGISTRY.get(op, {}) and not isinstance(reason, Declined):
            reasons.append(reason)
    raise ValueError(f"no backend can run {op} on {device}: {'; '.join(reasons)}")


def _environment_backend(op: str) -> Optional[str]:
    """``FLASHDSA_BACKEND`` when set and ``op`` has that backend, else None (automatic)."""
    name = os.environ.get(ENV_VAR) or None
    if name is not None and name not in BACKENDS:
        raise ValueError(f"{ENV_VAR} must be one of {BACKENDS}, got {name!r}")
    return name if name in _REGISTRY.get(op, {}) else None


def select(op: str, device: torch.device, backend: Optional[str] = None, **facts) -> Callable:
    """Return the implementation of ``op`` for ``device`` (the backend :func:`choose` names)."""
    return _load(_REGISTRY[op][_remembered(op, device, backend, facts)].target)


def available(op: str) -> list[str]:
    """Backends registered for ``op``, fastest first."""
    return [b for b in BACKENDS if b in _REGISTRY.get(op, {})]
