"""Input validation shared by the public ops: every failure is a ValueError naming the argument."""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from typing import Iterator, Optional, Sequence, Union

import torch

Dim = Union[int, None]  # None: any size


def describe(t: torch.Tensor) -> str:
    """``bfloat16 [4, 128, 576] on cuda:0`` style description for error messages."""
    dtype = str(t.dtype).removeprefix("torch.")
    return f"{dtype} {list(t.shape)} on {t.device}"


def check_tensor(
    name: str,
    t: object,
    dtype: Union[torch.dtype, Sequence[torch.dtype]],
    shape: Sequence[Dim],
    expected: str,
    device: Optional[torch.device] = None,
    contiguous: bool = True,
) -> None:
    """Raise ValueError unless ``t`` is a tensor of ``dtype`` whose shape matches ``shape``.

    ``expected`` is the human contract, e.g. ``"bf16 [s_q, h_q, d_qk]"``; it goes in the message.
    """
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a tensor {expected}, got {type(t).__name__}")
    dtypes = (dtype,) if isinstance(dtype, torch.dtype) else tuple(dtype)
    ok = t.dtype in dtypes and t.dim() == len(shape)
    ok = ok and all(want is None or want == got for want, got in zip(shape, t.shape))
    if not ok:
        raise ValueError(f"{name} must be {expected}, got {describe(t)}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} must be on {device} like the other inputs, got {describe(t)}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got strides {t.stride()} for {describe(t)}")


def check(condition: bool, message: str) -> None:
    """Raise ValueError(message) unless ``condition``."""
    if not condition:
        raise ValueError(message)


_values_trusted: ContextVar[bool] = ContextVar("flashdsa_values_trusted", default=False)


@contextmanager
def trusted_values() -> Iterator[None]:
    """Skip the checks that read tensor values back to the host (one device sync each) inside this
    block; shapes and dtypes are still checked. For callers that built the values themselves, like
    the engine's model runner, whose slot mappings and ranges come from its own block manager.
    The values must then be valid: an unchecked range or block id past its tensor is read as is."""
    token = _values_trusted.set(True)
    try:
        yield
    finally:
        _values_trusted.reset(token)


def can_check_values(device: torch.device) -> bool:
    """Whether value checks may read tensors back: not inside :func:`trusted_values`, nor while a
    CUDA graph is being captured (reading back is impossible there)."""
    if _values_trusted.get():
        return False
    return device.type != "cuda" or not torch.cuda.is_current_stream_capturing()
