"""Native kernel build: every CUDA source compiles for sm_90a (nvcc from PyPI in CI; skipped when
no nvcc is found), the build cache is keyed by the sources, a killed build's lock is removed, and a
missing toolchain makes the cuda backend unavailable with its reason (once, not per call)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from flashdsa import cli
from flashdsa.runtime import dispatch, native
from flashdsa.runtime.indexer import _cuda_topk_supports, indexer_topk
from flashdsa.runtime.kernels import _cuda_supports, sparse_mla_decode, sparse_mla_fwd


@pytest.mark.parametrize("ext", native.extensions(), ids=lambda e: e.name)
def test_native_sources_compile_for_sm90a_without_spills(ext, capsys):
    if native.missing_nvcc():
        pytest.skip(native.missing_nvcc())
    report = native.compile_check(ext)
    with capsys.disabled():  # registers, spills and shared memory per kernel, in the CI log
        print(f"\n{report}")
    kernels = re.findall(r"Compiling entry function '(\w+)' for 'sm_90a'", report)
    assert kernels, report
    functions = re.findall(r"Function properties for (\w+)", report)  # kernels and non-inlined functions
    spills = re.findall(r"(\d+) bytes spill stores", report)
    assert len(spills) == len(functions) >= len(kernels) and set(spills) == {"0"}, report


def test_there_is_a_native_extension_for_the_indexer():
    assert "indexer" in [e.op for e in native.extensions()]
    assert {p.name for p in native.Extension("indexer").files(".cu", ".cpp")} >= {"topk.cu", "topk_op.cpp"}


@pytest.fixture
def fake_op(tmp_path, monkeypatch):
    """An op folder with one kernel source under a temporary runtime; builds cached under tmp_path."""
    source = tmp_path / "runtime" / "myop" / "cuda" / "k.cu"
    source.parent.mkdir(parents=True)
    source.write_text("__global__ void k() {}\n")
    monkeypatch.setattr(native, "RUNTIME", tmp_path / "runtime")
    monkeypatch.setenv(native.CACHE_ENV, str(tmp_path / "cache"))
    return source


def test_build_directory_is_keyed_by_the_sources_and_the_shared_headers(fake_op, tmp_path):
    ext = native.Extension("myop")
    first = native.build_directory(ext, tmp_path)
    assert first.parent == tmp_path / "cache" and first.name.startswith("flashdsa_myop-")
    assert native.build_directory(ext, tmp_path) == first
    fake_op.write_text("__global__ void k() { }\n")
    second = native.build_directory(ext, tmp_path)
    assert second != first
    shared = tmp_path / "runtime" / native.SHARED_INCLUDE / "helpers.cuh"  # a header every extension may include
    shared.parent.mkdir()
    shared.write_text("#pragma once\n")
    third = native.build_directory(ext, tmp_path)
    assert third != second
    (shared.parent / "checks.h").write_text("#pragma once\n")  # a host header the ops may include
    assert native.build_directory(ext, tmp_path) != third


def test_a_killed_builds_lock_is_removed(tmp_path):
    directory = tmp_path / "flashdsa_x-0123"
    directory.mkdir()
    (directory / "lock").touch()  # what cpp_extension's FileBaton leaves when its process is killed
    with native.exclusive(directory):
        assert not (directory / "lock").exists()
    assert (tmp_path / "flashdsa_x-0123.flock").exists()


def test_without_nvcc_the_build_fails_once_with_the_reason(fake_op, monkeypatch):
    monkeypatch.setattr(native, "cuda_home", lambda: None)
    assert "nvcc not found" in native.missing_nvcc()
    monkeypatch.setattr(native, "_loaded", {})
    calls = []
    real_build = native.build
    monkeypatch.setattr(native, "build", lambda ext: calls.append(ext) or real_build(ext))
    for _ in range(3):
        with pytest.raises(ImportError, match="cannot build flashdsa_myop: .*(nvcc not found|without CUDA)"):
            native.load("myop")
    assert len(calls) == 1


def test_there_is_a_native_extension_for_the_sparse_attention():
    assert "kernels" in [e.op for e in native.extensions()]
    files = {p.name for p in native.Extension("kernels").files()}
    assert files >= {"sparse_attention.cu", "sparse_attention.h", "sparse_decode_op.cpp", "sparse_fwd_op.cpp"}


def test_build_kernels_reports_a_missing_toolchain_in_one_line_per_extension(monkeypatch, capsys):
    monkeypatch.setattr(native, "cuda_home", lambda: None)
    assert cli.main(["build-kernels", "--compile-only"]) == 1
    err = re.findall(r"flashdsa build-kernels: [^\r\n]*", capsys.readouterr().err)  # not tqdm's bar
    assert err == [f"flashdsa build-kernels: error: cannot compile {e.name}: nvcc not found: "
                   "set CUDA_HOME, or pip install 'flashdsa[nvcc]'" for e in native.extensions()]


def test_cuda_top_k_is_registered_and_refuses_what_it_cannot_serve(monkeypatch):
    monkeypatch.delenv(dispatch.ENV_VAR, raising=False)
    assert dispatch.available("indexer_topk")[0] == "cuda"
    logits = torch.randn(2, 10)
    with pytest.raises(ValueError, match="backend 'cuda' cannot run indexer_topk: cuda needs a CUDA device"):
        indexer_topk(logits, 4, backend="cuda")
    assert "topk <= 2048, got 2049" in _cuda_topk_supports(topk=2049)


def test_cuda_attention_is_registered_first_and_names_what_it_refuses(monkeypatch):
    monkeypatch.delenv(dispatch.ENV_VAR, raising=False)
    assert dispatch.available("sparse_mla_decode")[0] == "cuda"
    assert dispatch.available("sparse_mla_fwd")[0] == "cuda"
    facts = dict(dtype=torch.bfloat16, h_q=128, d_qk=576, d_v=512, topk=2048)
    assert _cuda_supports(**facts) == native.unavailable()  # automatic selection picks it where it builds
    assert _cuda_supports(**{**facts, "d_qk": 512}) == native.unavailable()
    for bad, message in ((dict(h_q=96), "h_q in (64, 128)"), (dict(topk=16385), "topk <= 16384"),
                         (dict(d_v=256), "d_v == 512"), (dict(d_qk=448), "d_qk in (512, 576)"),
                         (dict(dtype=torch.float32), "bf16")):
        assert message in _cuda_supports(**{**facts, **bad})
    q = torch.randn(1, 1, 64, 576).bfloat16()
    cache = torch.zeros(1, 64, 1, 656, dtype=torch.uint8)
    indices = torch.zeros(1, 1, 64, dtype=torch.int32)
    with pytest.raises(ValueError, match="backend 'cuda' cannot run sparse_mla_decode: cuda needs a CUDA device"):
        sparse_mla_decode(q, cache, indices, 0.1, backend="cuda")
    with pytest.raises(ValueError, match="backend 'cuda' cannot run sparse_mla_fwd: cuda needs a CUDA device"):
        sparse_mla_fwd(q[0], torch.zeros(64, 1, 576).bfloat16(), indices[0, :, None], 0.1, backend="cuda")


def test_extensions_link_the_cpp_runtime_torch_runs_on():
    """torch has loaded libstdc++; the build links that file by path, so a compiler that links
    libstdc++ statically cannot give the extension a private, uninitialized copy."""
    runtime = native.loaded_libstdcxx()
    assert runtime is not None and Path(runtime).name.startswith("libstdc++.so") and Path(runtime).is_file()
    assert native._link_flags() == [runtime]
