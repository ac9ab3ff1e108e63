"""The cuBLAS backend of fp8_gemm: which calls it takes (CPU: the dispatch decision, the probe's
caching, the scale layouts torch is handed and what they mean) and, on a Hopper GPU, that it
equals the reference (fp8_gemm_cases.py's tolerance), syncs nothing and replays in a CUDA graph."""

from __future__ import annotations

import logging

import pytest
import torch
from fp8_gemm_cases import assert_gemm_close, gemm_inputs

from flashdsa.runtime import dispatch
from flashdsa.runtime.gemm import GROUP, cublas, fp8_gemm, fp8_gemm_backend, reference
from flashdsa.testing import flood_cuda_allocator_with_nan

FAKE_GPU = torch.device("cuda", 0)  # only names a device: nothing runs on it in the CPU tests
Q_A, KV_A, WK, FUSED = (1536, 7168), (576, 7168), (128, 7168), (2240, 7168)


@pytest.fixture
def hopper(monkeypatch):
    """A probed, capable device 0, no forcing, no earlier fallback warnings."""
    monkeypatch.delenv(dispatch.ENV_VAR, raising=False)
    monkeypatch.setattr(cublas, "_probed", {0: None})
    monkeypatch.setattr(cublas, "_refused", set())
    monkeypatch.setattr(dispatch, "_warned", set())
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))


@pytest.mark.parametrize("n, k", [Q_A, KV_A, WK, FUSED, (7168, 18432), (24576, 1536)])
def test_prefill_sizes_go_to_cublas_and_decode_sizes_to_triton_silently(hopper, caplog, n, k):
    with caplog.at_level(logging.WARNING, logger=dispatch.__name__):
        for m in (1, 8, 64, cublas.CUBLAS_MIN_M - 1):
            assert fp8_gemm_backend(m, n, k, FAKE_GPU) == "triton", m
        for m in (cublas.CUBLAS_MIN_M, 300, 4096, 16384):
            assert fp8_gemm_backend(m, n, k, FAKE_GPU) == "cublas", m
    assert not caplog.records  # declining decode sizes is a choice, not a fallback


def test_an_m_off_the_scale_alignment_runs_on_triton_with_the_reason(hopper, caplog):
    with caplog.at_level(logging.WARNING, logger=dispatch.__name__):
        assert fp8_gemm_backend(4097, *FUSED, FAKE_GPU) == "triton"
    assert "M % 4 == 0" in caplog.text


@pytest.mark.parametrize("n, k, out_dtype, why", [
    (576, 896, torch.bfloat16, "K % 512 == 0"),  # K/128 = 7 would need padded weight scales
    (100, 7168, torch.bfloat16, "N % 16 == 0"), (576, 7168, torch.float32, "bf16 only"),
])
def test_shapes_cublas_cannot_take_fall_back_to_triton_with_the_reason(hopper, caplog, n, k, out_dtype, why):
    with caplog.at_level(logging.WARNING, logger=dispatch.__name__):
        assert fp8_gemm_backend(4096, n, k, FAKE_GPU, out_dtype) == "triton"
    assert why in caplog.text
    with pytest.raises(ValueError, match=why):
        fp8_gemm_backend(4096, n, k, FAKE_GPU, out_dtype, backend="cublas")


def test_a_failed_probe_keeps_triton_and_is_not_retried(hopper, monkeypatch):
    monkeypatch.setattr(cublas, "_probed", {0: "torch._scaled_mm refuses blockwise scales here: NOT_SUPPORTED"})
    monkeypatch.setattr(cublas, "_run_probe", lambda device: pytest.fail("probed twice"))
    assert fp8_gemm_backend(4096, *KV_A, FAKE_GPU) == "triton"
    with pytest.raises(ValueError, match="NOT_SUPPORTED"):
        fp8_gemm_backend(4096, *KV_A, FAKE_GPU, backend="cublas")


def test_an_unprobed_device_declines_while_a_graph_is_captured_and_probes_later(hopper, monkeypatch):
    monkeypatch.setattr(cublas, "_probed", {})
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    monkeypatch.setattr(cublas, "_run_probe", lambda device: pytest.fail("probed during capture"))
    assert fp8_gemm_backend(4096, *KV_A, FAKE_GPU) == "triton"
    assert cublas._probed == {}
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(cublas, "_run_probe", lambda device: None)
    assert fp8_gemm_backend(4096, *KV_A, FAKE_GPU) == "cublas" and cublas._probed == {0: None}


def test_cublas_is_for_hopper_onwards_and_cuda_devices(hopper, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 9))
    assert fp8_gemm_backend(4096, *KV_A, FAKE_GPU) == "triton"
    with pytest.raises(ValueError, match="cublas needs a CUDA device"):
        fp8_gemm_backend(4096, *KV_A, torch.device("cpu"), backend="cublas")
    assert fp8_gemm_backend(4096, *KV_A, torch.device("cpu")) == "reference"


def test_forcing_cublas_overrides_only_the_size_preference(hopper):
    assert fp8_gemm_backend(8, *KV_A, FAKE_GPU, backend="cublas") == "cublas"


@pytest.mark.parametrize("m, n, k", [(300, 576, 1024), (256, 128, 512), (257, 2240, 2048)])
def test_scales_are_handed_over_in_torchs_blockwise_layout_with_the_reference_meaning(m, n, k):
    x_fp8, x_scale, w_fp8, w_scale = gemm_inputs(m, n, k, "cpu")
    scale_a, scale_b = cublas.cublas_scales(x_scale, w_scale)
    kb, nb = k // GROUP, -(-n // GROUP)
    # x scales outer-dim-major; weight scales [K/128, N/128] with stride (1, K/128): a view, no copy
    assert scale_a.shape == (m, kb) and scale_a.stride() == (1, m)
    assert scale_b.shape == (kb, nb) and scale_b.stride() == (1, kb) and scale_b.data_ptr() == w_scale.data_ptr()
    # torch recognises the pair as (BlockWise1x128, BlockWise128x128) (its shape checks, on meta tensors)
    meta = [t.to("meta") for t in (x_fp8, w_fp8)]
    out = torch._scaled_mm(meta[0], meta[1].t(), scale_a=scale_a.to("meta"), scale_b=scale_b.to("meta"),
                           out_dtype=torch.bfloat16)
    assert out.shape == (m, n)
    # cuBLAS's meaning, y[i, j] = sum_k x[i, k] w[j, k] scale_a[i, k // 128] scale_b[k // 128, j // 128],
    # spelled out on the handed-over tensors, is the reference product
    a = x_fp8.float() * scale_a.repeat_interleave(GROUP, 1)
    b = w_fp8.float() * scale_b.repeat_interleave(GROUP, 0).repeat_interleave(GROUP, 1)[:, :n].t()
    assert torch.allclose(a @ b.t(), reference.fp8_gemm(x_fp8, x_scale, w_fp8, w_scale, torch.float32),
                          rtol=1e-5, atol=1e-5 * (a.abs() @ b.abs().t()).max().item())


# ---------------------------------------------------------------- GPU

cuda = torch.device("cuda")
GPU_CASES = [(256, *KV_A), (300, *WK), (1000, *Q_A), (4097, *FUSED), (16384, *KV_A), (2049, 7168, 16384),
             (16384, 7168, 18432), (777, 24576, 1536), (4096, 4096, 512), (513, 7168, 2048)]


def _need_hopper() -> None:
    if torch.cuda.get_device_capability() < cublas.MIN_CAPABILITY:
        pytest.skip("cuBLAS blockwise FP8 needs Hopper or newer")


@pytest.mark.gpu
def test_the_probe_passes_on_hopper():
    _need_hopper()
    assert cublas.probe(cuda) is None


@pytest.mark.gpu
@pytest.mark.parametrize("m, n, k", GPU_CASES)
def test_cublas_matches_reference(m, n, k):
    """Shapes cuBLAS takes run on it and match; an M off its alignment runs (and matches) on Triton."""
    _need_hopper()
    flood_cuda_allocator_with_nan(cuda)
    inputs = gemm_inputs(m, n, k, cuda)
    assert fp8_gemm_backend(m, n, k, cuda) == ("cublas" if m % cublas.M_MULTIPLE == 0 else "triton")
    assert_gemm_close(fp8_gemm(*inputs), *inputs, what=f"cublas M={m} N={n} K={k}")
    assert not cublas._refused


@pytest.mark.gpu
def test_cublas_call_is_sync_free_and_replays_in_a_cuda_graph():
    _need_hopper()
    inputs = gemm_inputs(cublas.CUBLAS_MIN_M, *FUSED, cuda)
    eager = fp8_gemm(*inputs)  # probes, if not yet done
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fp8_gemm(*inputs)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fp8_gemm(*inputs)
    captured.fill_(float("nan"))
    graph.replay()
    assert torch.equal(captured, eager)


@pytest.mark.gpu
def test_a_shape_cublas_refuses_runs_on_triton(monkeypatch):
    _need_hopper()
    monkeypatch.setattr(cublas, "_refused", set())
    inputs = gemm_inputs(300, *KV_A, cuda)

    def refuse(*_):
        raise RuntimeError("CUBLAS_STATUS_NOT_SUPPORTED")

    monkeypatch.setattr(cublas, "scaled_mm", refuse)
    assert_gemm_close(cublas.fp8_gemm(*inputs, torch.bfloat16), *inputs, what="refused")
    assert cublas._refused == {KV_A} and fp8_gemm_backend(300, *KV_A, cuda) == "triton"
