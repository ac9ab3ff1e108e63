"""Backend selection: forced backends, FLASHDSA_BACKEND, fallback, support-check reasons."""

import logging

import pytest
import torch

from flashdsa.runtime import dispatch
from flashdsa.runtime.kernels import _triton_supports, reference, sparse_mla_bwd, sparse_mla_fwd
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
    q, kv, indices = fwd_inputs()
    out = torch.zeros(*q.shape[:2], 512, dtype=q.dtype)
    with pytest.raises(ValueError, match="backend 'cuda' cannot run sparse_mla_bwd: cuda needs a CUDA device"):
        sparse_mla_bwd(q, kv, out, out, torch.zeros(q.shape[:2]), indices, 0.1, backend="cuda")
    with pytest.raises(ValueError, match="sparse_attention_v4_prefill has no cuda implementation"):
        dispatch.select("sparse_attention_v4_prefill", CPU, "cuda")


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


# ---------------------------------------------------------------- remembered choices

GPU = torch.device("cuda", 0)  # only names a device: nothing runs on it, and triton's device check passes
REFERENCE_TARGET = "flashdsa.runtime.kernels.reference:sparse_mla_fwd"


def counting_op(name: str, calls: list, stable: bool = True, triton_max: int = 8) -> str:
    """An op with a triton backend (its support check counted in ``calls``, serving n <= triton_max)
    and a reference one, registered afresh under ``name``."""
    def supports(n: int = 0, **_):
        calls.append(n)
        return None if n <= triton_max else dispatch.Declined(f"n={n} > {triton_max}")

    dispatch.register(name, "triton", REFERENCE_TARGET, supports, stable=stable)
    dispatch.register(name, "reference", REFERENCE_TARGET)
    return name


def test_a_cuda_choice_is_made_once_per_facts():
    calls = []
    op = counting_op("test_dispatch_remembered_op", calls)
    for _ in range(3):
        assert dispatch.choose(op, GPU, n=4) == "triton" and dispatch.choose(op, GPU, n=9) == "reference"
        assert dispatch.select(op, GPU, n=4) is reference.sparse_mla_fwd
    assert calls == [4, 9]
    assert dispatch.choose(op, GPU, backend="triton", n=9) == "triton"  # forced: runs though declined
    assert dispatch.choose(op, torch.device("cuda", 1), n=4) == "triton" and calls == [4, 9, 9, 4]


def test_registering_forgets_every_choice():
    op = counting_op("test_dispatch_reregistered_op", [])
    assert dispatch.choose(op, GPU, n=9) == "reference"
    counting_op(op, [], triton_max=16)
    assert dispatch.choose(op, GPU, n=9) == "triton"


def test_a_change_of_the_environment_variable_takes_effect_at_once(monkeypatch):
    op = counting_op("test_dispatch_environment_op", [])
    assert dispatch.choose(op, GPU, n=4) == "triton"
    monkeypatch.setenv(dispatch.ENV_VAR, "reference")
    assert dispatch.choose(op, GPU, n=4) == "reference"
    assert dispatch.choose(op, GPU, backend="triton", n=4) == "triton"  # an argument still wins
    monkeypatch.setenv(dispatch.ENV_VAR, "tilelang")
    for _ in range(2):  # a failure is not remembered
        with pytest.raises(ValueError, match="FLASHDSA_BACKEND must be one of"):
            dispatch.choose(op, GPU, n=4)
    monkeypatch.delenv(dispatch.ENV_VAR)
    assert dispatch.choose(op, GPU, n=4) == "triton"


def test_unstable_ops_unhashable_facts_and_other_devices_choose_every_call(monkeypatch):
    calls = []
    op = counting_op("test_dispatch_unstable_op", calls, stable=False)
    for _ in range(2):
        assert dispatch.choose(op, GPU, n=4) == "triton"
    assert len(calls) == 2
    op = counting_op("test_dispatch_stable_op", calls)
    for _ in range(2):
        assert dispatch.choose(op, GPU, n=4, shape=[1, 2]) == "triton"  # a list cannot key a dict
    assert len(calls) == 4
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # off CUDA devices the interpreter decides, read each call
    assert dispatch.choose(op, CPU, n=4) == "triton" and len(calls) == 5
    monkeypatch.delenv("TRITON_INTERPRET")
    assert dispatch.choose(op, CPU, n=4) == "reference"
