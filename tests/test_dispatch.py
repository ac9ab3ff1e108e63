"""Backend selection: forced backends, FLASHDSA_BACKEND, fallback, support-check reasons."""

import logging

import pytest
import torch

from flashdsa.runtime import dispatch
from flashdsa.runtime.kernels import _triton_supports, reference, sparse_mla_fwd
from flashdsa.testing import random_sparse_inputs

CPU = torch.device("cpu")
V32 = dict(dtype=torch.bfloat16, h_q=128, d_qk=576, d_v=512, topk=2048)


@pytest.fixture(autouse=True)
def no_forcing(monkeypatch):
    monkeypatch.delenv(dispatch.ENV_VAR, raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


def fwd_inputs():
    return random_sparse_inputs(2, 100, 4, 576, 64, torch.bfloat16, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("op", ["sparse_mla_fwd", "sparse_mla_bwd", "sparse_mla_decode"])
def test_fallback_picks_reference_on_cpu(op):
    assert dispatch.select(op, CPU, **V32) is getattr(reference, op)
    assert {"triton", "reference"} <= set(dispatch.available(op))


def test_forced_backend_that_cannot_serve_raises_with_the_reason():
    with pytest.raises(ValueError, match="backend 'triton' cannot run sparse_mla_fwd: triton needs a CUDA device"):
        sparse_mla_fwd(*fwd_inputs(), 0.1, backend="triton")
    with pytest.raises(ValueError, match="sparse_mla_fwd has no cuda implementation"):
        sparse_mla_fwd(*fwd_inputs(), 0.1, backend="cuda")


def test_forced_triton_reports_the_unsupported_shape(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # device accepted, so the support check speaks
    q, kv, indices = fwd_inputs()
    with pytest.raises(ValueError, match="triton takes bf16 inputs, got torch.float32"):
        sparse_mla_fwd(q.float(), kv.float(), indices, 0.1, backend="triton")
    with pytest.raises(ValueError, match="topk a multiple of 64 up to 8192, got 65"):
        sparse_mla_fwd(q, kv, torch.zeros(2, 1, 65, dtype=torch.int32), 0.1, backend="triton")


def test_environment_variable_forces_a_backend(monkeypatch):
    monkeypatch.setenv(dispatch.ENV_VAR, "reference")
    assert dispatch.select("sparse_mla_fwd", CPU, **V32) is reference.sparse_mla_fwd
    monkeypatch.setenv(dispatch.ENV_VAR, "triton")
    with pytest.raises(ValueError, match="backend 'triton' cannot run sparse_mla_fwd"):
        sparse_mla_fwd(*fwd_inputs(), 0.1)
    # an explicit argument wins over the environment
    assert sparse_mla_fwd(*fwd_inputs(), 0.1, backend="reference")[0].shape == (2, 4, 512)


def test_environment_variable_leaves_ops_without_that_backend_to_automatic_choice(monkeypatch):
    """FLASHDSA_BACKEND=cuda forces the native kernels that exist; every other op keeps choosing
    (an explicit backend= argument still refuses what it cannot run)."""
    op = "test_dispatch_reference_only_op"
    dispatch.register(op, "reference", "flashdsa.runtime.kernels.reference:sparse_mla_fwd")
    monkeypatch.setenv(dispatch.ENV_VAR, "cuda")
    assert dispatch.choose(op, CPU) == "reference"
    with pytest.raises(ValueError, match="has no cuda implementation"):
        dispatch.choose(op, CPU, backend="cuda")


def test_unknown_backend_is_rejected(monkeypatch):
    with pytest.raises(ValueError, match="backend must be one of"):
        sparse_mla_fwd(*fwd_inputs(), 0.1, backend="tilelang")
    monkeypatch.setenv(dispatch.ENV_VAR, "tilelang")
    with pytest.raises(ValueError, match="FLASHDSA_BACKEND must be one of"):
        sparse_mla_fwd(*fwd_inputs(), 0.1)
    with pytest.raises(ValueError, match="backend must be one of"):
        dispatch.register("sparse_mla_fwd", "tilelang", "x:y")


def test_unimportable_target_is_unavailable_and_automatic_choice_falls_back(monkeypatch, caplog):
    op = "test_dispatch_unimportable_op"
    dispatch.register(op, "triton", "flashdsa.no_such_module:fn")
    dispatch.register(op, "reference", "flashdsa.runtime.kernels.reference:sparse_mla_fwd")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(ValueError, match="cannot import flashdsa.no_such_module:fn"):
        dispatch.select(op, CPU, backend="triton")
    assert dispatch.select(op, CPU) is reference.sparse_mla_fwd
    cuda = torch.device("cuda", 0)  # only the device type is read: the fallback warning is for GPUs
    with caplog.at_level(logging.WARNING, logger=dispatch.__name__):
        for _ in range(3):
            assert dispatch.select(op, cuda) is reference.sparse_mla_fwd
    assert [r.getMessage() for r in caplog.records].count(
        f"{op} falls back to reference on cuda:0: cannot import flashdsa.no_such_module:fn: "
        "No module named 'flashdsa.no_such_module'") == 1


@pytest.mark.parametrize("change, reason", [
    (dict(), None),
    (dict(d_qk=512), None),
    (dict(topk=64, h_q=1), None),
    (dict(dtype=torch.float32), "bf16"),
    (dict(d_qk=192), "d_qk in (512, 576)"),
    (dict(d_v=128), "d_v == 512"),
    (dict(topk=100), None),  # decode: any topk
    (dict(topk=100, topk_multiple=64), "multiple of 64"),  # forward and backward
    (dict(topk=8256), "up to 8192"),
    (dict(h_q=129), "at most 128 query heads"),
])
def test_triton_support_check_explains_each_limit(change, reason):
    got = _triton_supports(**dict(V32, **change))
    assert got is None if reason is None else reason in got
