"""Input validation shared by the public ops: every failure is a ValueError naming the argument."""

from __future__ import annotations

from typing import Optional, Sequence, Union

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
