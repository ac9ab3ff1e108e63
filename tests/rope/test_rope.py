"""apply_rope_: the Triton kernel (interpreter on CPU, GPU) against the models' torch expressions."""

import pytest
import torch

from flashdsa.runtime.rope import apply_rope_
from flashdsa.runtime.rope.reference import cos_sin, rope_interleaved, rope_rotate_half
from flashdsa.testing import kernel_test_main, run_under_interpreter

# (tokens, heads, head dim, rotated dims): MLA's q_pe/k_pe, the indexer's q/k, corner sizes
CASES = [(1, 128, 64, 64), (3, 64, 128, 64), (5, 16, 64, 64), (2, 3, 24, 16), (0, 4, 64, 64), (4, 1, 8, 2)]


def inputs(tokens, heads, dim, rot, device, dtype, g):
    """q and k as strided views of wider projections (as the model's q_pe and k_pe are), YaRN-like
    frequencies, positions up to 128K."""
    q = torch.randn(tokens, heads, dim + 32, generator=g).to(device, dtype)[:, :, 32:]
    k = torch.randn(tokens, dim + 512, generator=g).to(device, dtype)[:, 512:]
    positions = torch.randint(0, 131072, (tokens,), generator=g).to(device)
    inv_freq = (1.0 / 10000 ** (torch.arange(0, rot, 2) / rot) / torch.linspace(1, 40, rot // 2)).to(device)
    return q, k, positions, inv_freq


def expected(x, positions, inv_freq, factor, interleaved, inverse=False):
    cos, sin = cos_sin(positions, inv_freq, factor)
    sin = -sin if inverse else sin
    rot = 2 * inv_freq.shape[0]
    rope = rope_interleaved if interleaved else rope_rotate_half
    return torch.cat([rope(x[..., :rot], cos, sin), x[..., rot:]], dim=-1)


def check_against_reference(device: str, dtype: torch.dtype, exact: bool) -> None:
    g = torch.Generator().manual_seed(0)
    for tokens, heads, dim, rot in CASES:
        for interleaved, alone in ((True, False), (False, False), (True, True)):
            q, k, positions, inv_freq = inputs(tokens, heads, dim, rot, device, dtype, g)
            factor = 1.0 if interleaved else 0.7071
            # alone: q without k, rotated back (inverse); k must stay as it is
            want_q = expected(q, positions, inv_freq, factor, interleaved, inverse=alone)
            want_k = k.clone() if alone else expected(k, positions, inv_freq, factor, interleaved)
            apply_rope_(q, None if alone else k, positions, inv_freq, factor, interleaved, inverse=alone,
                        backend="triton")
            for got, want in ((q, want_q), (k, want_k)):
                if exact:  # one rounding of a*c - b*s where torch rounds three times: within an ulp
                    ulp = 2.0**-8 if dtype == torch.bfloat16 else 2.0**-11
                    torch.testing.assert_close(got, want, rtol=2 * ulp, atol=ulp, msg=str((tokens, heads, dim, rot)))
                else:  # the interpreter's NumPy cos/sin may differ from torch's by an ulp
                    torch.testing.assert_close(got, want, rtol=4e-6, atol=4e-6)


def test_reference_rotates_in_place_like_the_model_expressions():
    g = torch.Generator().manual_seed(1)
    q, k, positions, inv_freq = inputs(3, 4, 128, 64, "cpu", torch.bfloat16, g)
    want_q, want_k = expected(q, positions, inv_freq, 1.5, False), expected(k, positions, inv_freq, 1.5, False)
    apply_rope_(q, k, positions, inv_freq, 1.5, False, backend="reference")
    assert torch.equal(q, want_q) and torch.equal(k, want_k)


def test_inverse_undoes_the_rotation_and_k_may_be_left_out():
    g = torch.Generator().manual_seed(2)
    q, _, positions, inv_freq = inputs(3, 4, 128, 64, "cpu", torch.float32, g)
    original = q.clone()
    apply_rope_(q, None, positions, inv_freq, 1.0, True, backend="reference")
    assert not torch.allclose(q, original)
    apply_rope_(q, None, positions, inv_freq, 1.0, True, inverse=True, backend="reference")
    torch.testing.assert_close(q, original, rtol=1e-5, atol=1e-5)


def test_pairs_are_rotated_by_position_times_frequency():
    q = torch.tensor([[[1.0, 0.0, 1.0, 0.0]]])
    k = torch.tensor([[0.0, 1.0, 0.0, 1.0]])
    apply_rope_(q, k, torch.tensor([2]), torch.tensor([0.25, 0.5]), 1.0, True)
    angles = torch.tensor([0.5, 1.0])
    assert torch.allclose(q[0, 0], torch.stack([angles.cos(), angles.sin()], -1).flatten())
    assert torch.allclose(k[0], torch.stack([-angles.sin(), angles.cos()], -1).flatten())


@pytest.mark.parametrize("bad, message", [
    (dict(q=torch.ones(2, 3, 64, dtype=torch.int32)), "q must be"), (dict(k=torch.ones(2, 32)), "k must be"),
    (dict(k=torch.ones(2, 64).bfloat16()), "k must be"), (dict(positions=torch.ones(2)), "positions must be"),
    (dict(positions=torch.ones(3, dtype=torch.int64)), "positions must be"),
    (dict(inv_freq=torch.ones(33)), "inv_freq must be"), (dict(inv_freq=torch.ones(32).double()), "inv_freq must be"),
    (dict(q=torch.ones(2, 64, 3).transpose(1, 2)), "q must have a contiguous last dim"),
    (dict(attention_factor=float("nan")), "attention_factor must be"), (dict(interleaved=1), "interleaved must be"),
    (dict(inverse=None), "inverse must be")])
def test_bad_arguments_name_themselves(bad, message):
    args = dict(q=torch.ones(2, 3, 64), k=torch.ones(2, 64), positions=torch.zeros(2, dtype=torch.int64),
                inv_freq=torch.ones(32), attention_factor=1.0, interleaved=True) | bad
    with pytest.raises(ValueError, match=message):
        apply_rope_(**args)


def test_triton_kernel_matches_reference_in_the_interpreter():
    run_under_interpreter(__file__, 0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_kernel_matches_reference_within_an_ulp_on_gpu(dtype):
    check_against_reference("cuda", dtype, exact=True)


@pytest.mark.gpu
def test_triton_kernel_matches_fp32_reference_on_gpu():
    check_against_reference("cuda", torch.float32, exact=False)  # fp32: the GPU may fuse a*c - b*s into an FMA


if __name__ == "__main__":
    kernel_test_main(lambda: check_against_reference("cpu", torch.float32, exact=False),
                     lambda: check_against_reference("cuda", torch.bfloat16, exact=True))
