"""Every public sparse MLA function rejects bad arguments with a ValueError naming the argument."""

import re

import pytest
import torch

from flashdsa.runtime.cache.layout import MLA_TOKEN_BYTES
from flashdsa.runtime.kernels import sparse_mla_bwd, sparse_mla_decode, sparse_mla_fwd

S_Q, H_Q, D_QK, D_V, TOPK, S_KV = 3, 4, 576, 512, 64, 10


def fwd_args():
    return dict(q=torch.randn(S_Q, H_Q, D_QK), kv=torch.randn(S_KV, 1, D_QK),
                indices=torch.zeros(S_Q, 1, TOPK, dtype=torch.int32), sm_scale=0.1, d_v=D_V)


def bwd_args():
    return dict(fwd_args(), out=torch.randn(S_Q, H_Q, D_V), dout=torch.randn(S_Q, H_Q, D_V),
                lse=torch.randn(S_Q, H_Q))


def decode_args():
    return dict(q=torch.randn(2, S_Q, H_Q, D_QK), kv_cache=torch.zeros(3, 64, 1, MLA_TOKEN_BYTES, dtype=torch.uint8),
                indices=torch.zeros(2, S_Q, TOPK, dtype=torch.int32), sm_scale=0.1, d_v=D_V)


FUNCTIONS = {"fwd": (sparse_mla_fwd, fwd_args), "bwd": (sparse_mla_bwd, bwd_args),
             "decode": (sparse_mla_decode, decode_args)}
TENSORS = {"fwd": ["q", "kv", "indices"], "bwd": ["q", "kv", "indices", "out", "dout", "lse"],
           "decode": ["q", "kv_cache", "indices"]}


def wrong_dtype(t):
    if t.is_floating_point():
        return t.to(torch.int64)
    return t.to(torch.float16 if t.dtype == torch.int32 else torch.int32)


def narrower(t):
    return t[..., :-1].contiguous()


def fewer_rows(t):
    return t[:-1]


def extra_dim(t):
    return t.unsqueeze(0)


def non_contiguous(t):
    return torch.cat([t, t], dim=-1)[..., : t.shape[-1]]


def other_device(t):
    return t.to("meta")


def not_a_tensor(t):
    return t.tolist()


BREAKERS = [wrong_dtype, extra_dim, non_contiguous, other_device, not_a_tensor]


def breakers(fn, arg):
    """q defines the device and (fwd/bwd) the sizes the others must match; topk is free."""
    if arg == "q":
        return [b for b in BREAKERS if b is not other_device] + ([narrower] if fn == "decode" else [])
    return BREAKERS + [fewer_rows if arg == "indices" else narrower]


CASES = [(fn, arg, brk) for fn, names in TENSORS.items() for arg in names for brk in breakers(fn, arg)]


def call(fn_name, **changes):
    fn, make = FUNCTIONS[fn_name]
    return fn(**dict(make(), **changes))


@pytest.mark.parametrize("fn", FUNCTIONS)
def test_valid_arguments_pass(fn):
    call(fn)


@pytest.mark.parametrize("fn, arg, breaker", CASES, ids=[f"{f}-{a}-{b.__name__}" for f, a, b in CASES])
def test_bad_tensor_is_rejected_naming_the_argument(fn, arg, breaker):
    bad = breaker(FUNCTIONS[fn][1]()[arg])
    with pytest.raises(ValueError, match=rf"^{arg} must"):
        call(fn, **{arg: bad})


@pytest.mark.parametrize("fn", FUNCTIONS)
@pytest.mark.parametrize("sm_scale", [0.0, -0.1, float("nan"), float("inf"), "0.1", True, None])
def test_bad_sm_scale_is_rejected(fn, sm_scale):
    with pytest.raises(ValueError, match="^sm_scale must be a positive finite float"):
        call(fn, sm_scale=sm_scale)


@pytest.mark.parametrize("fn", FUNCTIONS)
@pytest.mark.parametrize("d_v", [0, -1, D_QK + 1, 512.0, True])
def test_bad_d_v_is_rejected(fn, d_v):
    with pytest.raises(ValueError, match=re.escape(f"d_v must be an int in [1, d_qk={D_QK}]")):
        call(fn, d_v=d_v)


@pytest.mark.parametrize("fn", FUNCTIONS)
def test_empty_topk_is_rejected(fn):
    shape = (2, S_Q, 0) if fn == "decode" else (S_Q, 1, 0)
    with pytest.raises(ValueError, match="^indices must have topk > 0"):
        call(fn, indices=torch.zeros(shape, dtype=torch.int32))


def test_mismatched_shapes_across_arguments_are_rejected():
    with pytest.raises(ValueError, match=r"^kv must be float32 \[s_kv, 1, d_qk=576\]"):
        call("fwd", kv=torch.randn(S_KV, 1, 512))
    with pytest.raises(ValueError, match=r"^kv must be float32"):
        call("fwd", kv=torch.randn(S_KV, 1, D_QK, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"^indices must be int32 \[s_q=3, 1, topk\], got int32 \[4, 1, 64\] on cpu"):
        call("fwd", indices=torch.zeros(4, 1, TOPK, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"^out must be float32 \[s_q=3, h_q=4, d_v=256\]"):
        call("bwd", d_v=256)
    with pytest.raises(ValueError, match=r"^indices must be int32 \[b=2, s_q=3, topk\]"):
        call("decode", indices=torch.zeros(1, S_Q, TOPK, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"^q must have d_qk = 576"):
        call("decode", q=torch.randn(2, S_Q, H_Q, 512))
    with pytest.raises(ValueError, match=r"^q must have h_q > 0"):
        call("fwd", q=torch.randn(S_Q, 0, D_QK))


def test_bwd_rejects_non_bool_deterministic():
    with pytest.raises(ValueError, match="^deterministic must be a bool"):
        call("bwd", deterministic=1)
