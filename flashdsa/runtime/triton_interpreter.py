"""Make Triton 3.6's interpreter (``TRITON_INTERPRET=1``, the CPU test mode) run flashdsa's kernels.

Interpreter gaps, patched only when :func:`patch_interpreter` is called (the CPU tests do, in
their interpreter subprocess, through ``flashdsa.testing.kernel_test_main``; nothing on a GPU
touches this):
- a loop bound computed at run time is a 1-element array, and NumPy >= 2.3 refuses ``int()``
  of it, so ``for i in range(start, end)`` with tensor bounds fails;
- ``tl.dot`` on bf16 operands multiplies their raw uint16 bit patterns; they are widened to
  fp32 first here (exact), as a GPU tensor core does;
- float -> bf16 and float -> e4m3 casts truncate (and mishandle subnormals) instead of rounding
  to nearest even like the GPU; they go through torch's casts here;
- arithmetic on two bf16 operands (``x + residual`` of two bf16 loads) adds their raw uint16 bit
  patterns; it is computed in fp32 and rounded to bf16 here, as the GPU does.
"""

from __future__ import annotations

import numpy as np
import torch
import triton.language as tl
from triton.runtime import interpreter


def _bf16_as_fp32(handle: interpreter.TensorHandle) -> interpreter.TensorHandle:
    if handle.dtype.scalar != tl.bfloat16:
        return handle
    return interpreter.TensorHandle((handle.data.astype(np.uint32) << 16).view(np.float32), tl.float32)


_TORCH_DTYPES = {tl.float32: torch.float32, tl.float16: torch.float16, tl.bfloat16: torch.bfloat16,
                 tl.float8e4nv: torch.float8_e4m3fn}


def _rounding_cast(cast):
    """Wrap an interpreter cast so float -> bf16 / e4m3 rounds to nearest even (through torch)."""

    def patched(self, src, dst_type, *args):
        src_ty, dst_ty = src.dtype.scalar, dst_type.scalar
        if dst_ty in (tl.bfloat16, tl.float8e4nv) and src_ty in _TORCH_DTYPES and src_ty != dst_ty:
            data = torch.from_numpy(np.ascontiguousarray(src.data)).view(_TORCH_DTYPES[src_ty])
            out = data.to(_TORCH_DTYPES[dst_ty])
            bits = torch.uint16 if dst_ty == tl.bfloat16 else torch.uint8
            return interpreter.TensorHandle(out.view(bits).numpy(), dst_ty)
        return cast(self, src, dst_type, *args)

    return patched


def _bf16_arithmetic(create):
    """Wrap a float binary op of the interpreter so bf16 operands compute in fp32 and round back."""

    def patched(self, lhs, rhs):
        if lhs.dtype.scalar != tl.bfloat16 or rhs.dtype.scalar != tl.bfloat16:
            return create(self, lhs, rhs)
        out = create(self, _bf16_as_fp32(lhs), _bf16_as_fp32(rhs)).data
        bits = torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32)).to(torch.bfloat16).view(torch.uint16)
        return interpreter.TensorHandle(bits.numpy().reshape(np.shape(out)), tl.bfloat16)

    return patched


BF16_ARITHMETIC = ("create_fadd", "create_fsub", "create_fmul", "create_fdiv", "create_precise_divf", "create_frem",
                   "create_minimumf", "create_maximumf", "create_minnumf", "create_maxnumf")


def patch_interpreter() -> None:
    """Install the fixes (idempotent)."""
    if getattr(interpreter, "_flashdsa_patched", False):
        return
    patch_tensor = interpreter._patch_lang_tensor
    create_dot = interpreter.InterpreterBuilder.create_dot

    def patched_tensor(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    def patched_dot(self, a, b, d, *args):
        return create_dot(self, _bf16_as_fp32(a), _bf16_as_fp32(b), d, *args)

    builder = interpreter.InterpreterBuilder
    for name in BF16_ARITHMETIC:
        setattr(builder, name, _bf16_arithmetic(getattr(builder, name)))
    builder.cast_impl = _rounding_cast(builder.cast_impl)
    builder.create_fp_to_fp = _rounding_cast(builder.create_fp_to_fp)
    interpreter._patch_lang_tensor = patched_tensor
    interpreter.InterpreterBuilder.create_dot = patched_dot
    interpreter._flashdsa_patched = True
