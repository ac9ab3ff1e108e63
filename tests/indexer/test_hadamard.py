"""hadamard_transform is the orthogonal Sylvester-order Walsh-Hadamard rotation x @ H / sqrt(n)."""

import pytest
import torch

from flashdsa.runtime import dispatch, indexer
from flashdsa.runtime.indexer import hadamard_transform


@pytest.fixture(autouse=True)
def reference_backend(monkeypatch):
    """These tests pin down the reference ops; GPU backends are tested against them elsewhere."""
    monkeypatch.setenv("FLASHDSA_BACKEND", "reference")


def sylvester(n: int) -> torch.Tensor:
    """Explicit Sylvester Hadamard matrix: H_1 = [1], H_2m = [[H_m, H_m], [H_m, -H_m]]."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


@pytest.mark.parametrize("n", [1, 2, 8, 32, 128])
@pytest.mark.parametrize("lead", [(), (3,), (2, 5)])
def test_matches_explicit_sylvester_matrix(n, lead):
    x = torch.randn(*lead, n, dtype=torch.float64, generator=torch.Generator().manual_seed(n))
    torch.testing.assert_close(hadamard_transform(x), x @ sylvester(n) / n**0.5, rtol=1e-12, atol=1e-12)


def test_is_orthogonal_and_its_own_inverse():
    m = hadamard_transform(torch.eye(128, dtype=torch.float64))
    torch.testing.assert_close(m @ m.T, torch.eye(128, dtype=torch.float64), rtol=0, atol=1e-12)
    x = torch.randn(7, 128, dtype=torch.float64)
    torch.testing.assert_close(hadamard_transform(hadamard_transform(x)), x, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_keeps_dtype_and_rounds_once_from_fp32_math(dtype):
    x = torch.randn(64, 128).to(dtype)
    got = hadamard_transform(x)
    assert got.dtype == dtype and got.shape == x.shape
    exact = x.double() @ sylvester(128) / 128**0.5
    ulp = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-23}[dtype]
    assert ((got.double() - exact).abs() <= ulp * exact.abs() + 1e-6 * x.double().norm(dim=-1, keepdim=True)).all()


def test_leaves_bf16_scores_unchanged_up_to_rounding():
    """Rotating q and k in bf16 changes q . k only by the bf16 rounding of the rotated values:
    each is off by at most 2^-9 relative, so |delta| <= (2 * 2^-9 + 2^-18) * sum_i |Hq_i| |Hk_i|
    (plus fp32 accumulation, below 2^-16 of the same sum)."""
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(40, 128, generator=g).bfloat16(), torch.randn(50, 128, generator=g).bfloat16()
    plain = q.double() @ k.double().T
    hq, hk = hadamard_transform(q), hadamard_transform(k)
    rotated = hq.float() @ hk.float().T
    bound = (2 * 2.0**-9 + 2.0**-18 + 2.0**-16) * (hq.double().abs() @ hk.double().abs().T)
    delta = (rotated.double() - plain).abs()
    assert (delta <= bound).all()
    assert delta.max() > 0  # the rounding is real: the check would see a wrong rotation


@pytest.mark.parametrize("bad", [
    torch.randn(4, 96), torch.randn(4, 0), torch.randint(0, 3, (4, 128)), torch.tensor(1.0), [1.0] * 128,
])
def test_rejects_bad_input_naming_x(bad):
    with pytest.raises(ValueError, match="x"):
        hadamard_transform(bad)


def test_every_indexer_op_has_reference_and_triton_backends_registered():
    ops = ("hadamard_transform", "indexer_logits")
    assert all(dispatch.available(op) == ["triton", "reference"] for op in ops)
    for op in ("indexer_logits_paged", "indexer_topk", "indexer_fused_topk"):
        assert dispatch.available(op) == ["cuda", "triton", "reference"]


@pytest.mark.parametrize("facts, reason", [
    (dict(head_dim=64), "head_dim"), (dict(dtype=torch.float64), "float64"), (dict(topk=8193), "topk"),
    (dict(block_size=48), "block size"),
])
def test_triton_support_check_names_what_it_cannot_serve(facts, reason):
    assert reason in indexer._triton_supports(**facts)
    assert indexer._triton_supports(head_dim=128, dtype=torch.bfloat16, topk=2048, block_size=64) is None


def test_rotate_quantize_is_the_rotation_then_the_quantization():
    """The queries' fused op is quantize_indexer(hadamard_transform(x)) by definition; bad x names x."""
    x = torch.randn(2, 3, 128).bfloat16()
    codes, scale = indexer.rotate_quantize_indexer(x)
    want_codes, want_scale = indexer.quantize_indexer(hadamard_transform(x))
    assert codes.shape == (2, 3, 128) and scale.shape == (2, 3)
    assert torch.equal(codes.view(torch.uint8), want_codes.view(torch.uint8)) and torch.equal(scale, want_scale)
    for bad in (torch.randn(3, 64), torch.randn(3, 128, dtype=torch.float64), torch.zeros(128, dtype=torch.int32)):
        with pytest.raises(ValueError, match="^x must be"):
            indexer.rotate_quantize_indexer(bad)


@pytest.mark.parametrize("facts, reason", [
    (dict(block_size=128), "64-token cache blocks"), (dict(next_n=5), "256 columns"),
    (dict(next_n=3, heads=128), "256 columns"), (dict(heads=257), "256 columns"),
])
def test_cuda_paged_support_check_names_what_it_cannot_serve(facts, reason):
    assert reason in indexer._cuda_paged_supports(**facts)
