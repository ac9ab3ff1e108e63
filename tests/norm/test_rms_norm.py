"""rms_norm: the Triton kernel (interpreter on CPU, GPU) against the reference; checks name arguments."""

import os
import subprocess
import sys

import pytest
import torch

from flashdsa.runtime.norm import rms_norm

CASES = [(1, 7168), (5, 1536), (3, 512), (0, 64), (4, 100)]


def check_against_reference(device: str, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    for rows, dim in CASES:
        wide = torch.randn(rows, dim + 64, generator=g).to(device, dtype)
        x = wide[:, :dim]  # strided rows, as the model's c_kv view
        weight = (1 + 0.1 * torch.randn(dim, generator=g)).to(device, dtype)
        residual = torch.randn(rows, dim, generator=g).to(device, dtype)
        for res, fp32_product, w in ((None, False, weight), (residual, False, weight), (None, True, weight.float()),
                                     (residual, True, weight.float()), (None, False, None)):
            # fp32_product: DeepSeek-V4's fp32 weight on bf16 rows; None: its weightless head norm
            got_y, got_h = rms_norm(x, w, 1e-6, res, fp32_product=fp32_product, backend="triton")
            ref_y, ref_h = rms_norm(x, w, 1e-6, res, fp32_product=fp32_product, backend="reference")
            assert got_y.dtype == dtype and got_y.shape == (rows, dim)
            # the same roundings; only the fp32 mean's summation order differs: one ulp at most
            torch.testing.assert_close(got_y, ref_y, rtol=2**-7 if dtype == torch.bfloat16 else 1e-5, atol=1e-5)
            if res is None:
                assert got_h is None
            else:
                assert torch.equal(got_h, ref_h)


def test_reference_is_hugging_face_rmsnorm():
    x, w = torch.randn(3, 16).bfloat16(), torch.randn(16).bfloat16()
    xf = x.float()
    want = w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)
    y, h = rms_norm(x, w, 1e-6)
    assert torch.equal(y, want) and h is None
    y, h = rms_norm(x, w, 1e-6, x)
    assert torch.equal(h, x + x) and torch.equal(y, rms_norm(x + x, w, 1e-6)[0])


def test_without_a_weight_it_is_deepseek_v4s_head_normalization():
    from flashdsa.runtime.hyper import rms_normalize

    x = torch.randn(5, 64).bfloat16()
    y, h = rms_norm(x, None, 1e-6, backend="reference")
    assert torch.equal(y, rms_normalize(x, 1e-6)) and h is None


def test_fp32_product_is_deepseek_v4s_rmsnorm():
    from flashdsa.models.hyper_connections import RMSNorm

    norm = RMSNorm(16, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(16))
    x = torch.randn(3, 16).bfloat16()
    y, _ = rms_norm(x, norm.weight.detach(), 1e-6, fp32_product=True, backend="reference")
    xf = x.float()
    want = (norm.weight.detach() * (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + 1e-6))).to(x.dtype)
    assert torch.equal(y, want) and torch.equal(norm(x), want)


@pytest.mark.parametrize("bad, message", [
    (dict(weight=torch.ones(8)), "weight must be"), (dict(eps=0.0), "eps must be"),
    (dict(residual=torch.ones(2, 16)), "residual must be"), (dict(x=torch.ones(4, 16, dtype=torch.int32)), "x must be"),
    (dict(fp32_product=1), "fp32_product must be"), (dict(weight=torch.ones(16, 2)), "weight must be")])
def test_bad_arguments_name_themselves(bad, message):
    args = dict(x=torch.ones(4, 16), weight=torch.ones(16), eps=1e-6, residual=None) | bad
    with pytest.raises(ValueError, match=message):
        rms_norm(**args)


def test_triton_kernel_matches_reference_in_the_interpreter():
    code = "from tests.norm.test_rms_norm import check_against_reference as c; import torch; c('cpu', torch.float32)"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=os.getcwd())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_kernel_matches_reference_on_gpu(dtype):
    check_against_reference("cuda", dtype)
