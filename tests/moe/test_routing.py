"""select_experts (reference and triton backends) against a plain, per-token re-statement of
DeepSeek-V3's group-limited routing; the triton kernel runs under TRITON_INTERPRET=1 on CPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flashdsa.runtime.moe import select_experts
from flashdsa.runtime.moe.reference import routing_scores
from flashdsa.testing import kernel_test_main, run_under_interpreter
from moe_cases import SEED, generator


def restated(scores: torch.Tensor, bias: torch.Tensor, top_k: int, n_group: int, topk_group: int, norm: bool,
             factor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Token by token in fp32 NumPy from the sigmoid scores ``s``: rank groups by the sum of their
    two best ``s + bias`` (ties to the lower group), keep ``topk_group``, take the ``top_k`` best
    experts in them (ties to the lower expert), weight them by their scores."""
    scores = scores.numpy()
    choice = scores + bias.numpy()
    per_group = scores.shape[1] // n_group
    all_ids, all_weights = [], []
    for s, c in zip(scores, choice):
        groups = [c[g * per_group:(g + 1) * per_group] for g in range(n_group)]
        group_score = [np.float32(sorted(grp)[-1]) + np.float32(sorted(grp)[-2]) if per_group > 1 else grp[0]
                       for grp in groups]
        kept = sorted(range(n_group), key=lambda g: (-group_score[g], g))[:topk_group]
        candidates = [e for g in kept for e in range(g * per_group, (g + 1) * per_group)]
        ids = sorted(candidates, key=lambda e: (-c[e], e))[:top_k]
        w = np.array([s[e] for e in ids], dtype=np.float64)
        if norm:
            w = w / (w.sum() + 1e-20)
        all_ids.append(ids)
        all_weights.append(w * factor)
    shape = (scores.shape[0], top_k)
    return torch.tensor(np.array(all_weights).reshape(shape)), torch.tensor(all_ids, dtype=torch.int32).view(shape)


def check_routing(logits, bias, top_k, n_group, topk_group, norm=True, factor=2.5, backend=None, scoring="sigmoid"):
    weights, ids = select_experts(logits, bias, top_k, n_group, topk_group, norm, factor, scoring=scoring,
                                  backend=backend)
    scores = routing_scores(logits, scoring).cpu()  # the scores of the op's device: the ranking starts from them
    want_weights, want_ids = restated(scores, bias.cpu(), top_k, n_group, topk_group, norm, factor)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    differ = int((ids.cpu() != want_ids).sum())
    assert differ == 0, f"seed {SEED}: experts differ in {differ} places"
    torch.testing.assert_close(weights.cpu().double(), want_weights, rtol=1e-6, atol=1e-7, msg=f"seed {SEED}")


def tied_logits(tokens: int, experts: int, g: torch.Generator) -> torch.Tensor:
    """Logits from 5 values, so experts tie and groups tie on their two-best sums."""
    return (torch.randint(-2, 3, (tokens, experts), generator=g).float() * 0.5)


CASES = [
    (7, 256, 8, 8, 4),  # DeepSeek-V3.2
    (5, 64, 6, 1, 1),  # no groups
    (9, 16, 4, 4, 4),  # every group kept: plain top-k
    (3, 12, 2, 6, 1),  # groups of two, one kept
    (4, 20, 8, 5, 2),  # top_k takes every expert of the kept groups
    (6, 24, 3, 3, 2),  # groups of 8 in a padded 4 x 8 tile
    (1, 1, 1, 1, 1),
]


@pytest.mark.parametrize("tokens, experts, top_k, n_group, topk_group", CASES)
@pytest.mark.parametrize("ties", [False, True])
def test_routing_matches_the_restated_math(tokens, experts, top_k, n_group, topk_group, ties, backend=None):
    g = generator(tokens, experts, top_k, n_group, ties)
    logits = tied_logits(tokens, experts, g) if ties else torch.randn(tokens, experts, generator=g) * 2
    bias = torch.zeros(experts) if ties else torch.randn(experts, generator=g) * 0.1
    check_routing(logits, bias, top_k, n_group, topk_group, backend=backend)


@pytest.mark.parametrize("scoring", ["sqrtsoftplus", "softmax"])
@pytest.mark.parametrize("tokens, experts, top_k", [(7, 256, 6), (5, 64, 8), (3, 9, 2)])
def test_deepseek_v4_scorings_match_the_restated_math(tokens, experts, top_k, scoring, backend=None):
    """V4's router: no groups, sqrt(softplus) (or softmax) scores, logits past softplus's threshold of 20."""
    g = generator(tokens, experts, top_k, len(scoring))
    logits = torch.randn(tokens, experts, generator=g) * 4
    logits[0, :3] = torch.tensor([25.0, -30.0, 20.5])
    check_routing(logits, torch.randn(experts, generator=g) * 0.1, top_k, 1, 1, True, 1.5, backend, scoring)


def test_triton_routing_takes_sqrtsoftplus_not_softmax():
    from flashdsa.runtime.moe import _triton_routes

    assert _triton_routes(256, 6, scoring="sqrtsoftplus") is None
    assert "sigmoid or sqrtsoftplus, got softmax" in _triton_routes(256, 6, scoring="softmax")
    with pytest.raises(ValueError, match="scoring must be one of"):
        select_experts(torch.zeros(2, 8), torch.zeros(8), 2, 1, 1, True, 1.0, scoring="tanh")


def test_bf16_logits_route_as_their_fp32_widening(backend=None):
    """A bf16 router GEMM's output goes in as it is (no cast kernel): the same experts and bit-equal
    weights as its exact fp32 widening, for V4's scores (256 experts, top-6) and V3.2's groups,
    ties included (the tied logits are exact in bf16)."""
    g = generator(4)
    for logits in ((torch.randn(7, 256, generator=g) * 3).bfloat16(), tied_logits(5, 256, g).bfloat16()):
        bias = torch.randn(256, generator=g) * 0.01
        for args in ((6, 1, 1, True, 1.5, "sqrtsoftplus"), (8, 8, 4, True, 2.5, "sigmoid")):
            *rest, scoring = args
            got = select_experts(logits, bias, *rest, scoring=scoring, backend=backend)
            want = select_experts(logits.float(), bias, *rest, scoring=scoring, backend=backend)
            assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0]), f"seed {SEED}"


def triton_cases() -> None:
    """Every case on the triton backend, with and without ties, plus unnormalized weights, V4's
    scores and bf16 logits."""
    for case in CASES:
        for ties in (False, True):
            test_routing_matches_the_restated_math(*case, ties, backend="triton")
    g = generator(1)
    check_routing(torch.randn(6, 32, generator=g), torch.randn(32, generator=g), 4, 4, 2, False, 1.5, "triton")
    for case in [(7, 256, 6), (5, 64, 8), (3, 9, 2)]:
        test_deepseek_v4_scorings_match_the_restated_math(*case, "sqrtsoftplus", backend="triton")
    test_bf16_logits_route_as_their_fp32_widening(backend="triton")


def test_triton_routing_under_interpreter():
    run_under_interpreter(__file__, SEED)


def test_weights_without_normalization_are_scaled_scores():
    g = generator(1)
    logits, bias = torch.randn(6, 32, generator=g), torch.randn(32, generator=g) * 0.1
    check_routing(logits, bias, 4, 4, 2, norm=False, factor=1.5)
    weights, ids = select_experts(logits, bias, 4, 4, 2, False, 1.5)
    torch.testing.assert_close(weights, logits.sigmoid().gather(1, ids.long()) * 1.5)


def test_no_tokens():
    weights, ids = select_experts(torch.zeros(0, 16), torch.zeros(16), 2, 4, 2, True, 1.0)
    assert weights.shape == ids.shape == (0, 2)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 128, 4096])
def test_triton_routing_equals_reference_on_gpu(tokens):
    """V3.2's routing on random and tied logits: the same experts (but for near-ties an ulp apart);
    the weights within a few fp32 ulps (a sigmoid an ulp off moves the normalised weights of its row;
    2.5e-7 failed at 4096 tokens on an H200)."""
    g = generator(3, tokens)
    for logits in (torch.randn(tokens, 256, generator=g) * 3, tied_logits(tokens, 256, g)):
        logits, bias = logits.cuda(), (torch.randn(256, generator=g) * 0.01).cuda()
        got_w, got_ids = select_experts(logits, bias, 8, 8, 4, True, 2.5, backend="triton")
        want_w, want_ids = select_experts(logits, bias, 8, 8, 4, True, 2.5, backend="reference")
        # The kernel's sigmoid may differ from torch's by an fp32 ulp, which can swap two experts
        # whose scores are that close (seen: a few rows of 4096 on an H100); everything else is equal.
        same = (got_ids == want_ids).all(1)
        assert same.float().mean() >= 0.995, f"seed {SEED}: {int((~same).sum())} of {tokens} rows differ"
        torch.testing.assert_close(got_w[same], want_w[same], rtol=1e-6, atol=0, msg=f"seed {SEED}")


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 32])
def test_triton_routing_of_bf16_logits_equals_their_widening_on_gpu(tokens):
    """V4-Flash's routed layers (256 experts, top-6, sqrt(softplus)): bf16 logits, read as they
    are, route exactly as their fp32 widening does, on the kernel and against the reference."""
    g = generator(5, tokens)
    logits = (torch.randn(tokens, 256, generator=g) * 3).bfloat16().cuda()
    bias = (torch.randn(256, generator=g) * 0.01).cuda()
    got_w, got_ids = select_experts(logits, bias, 6, 1, 1, True, 1.5, scoring="sqrtsoftplus", backend="triton")
    want_w, want_ids = select_experts(logits.float(), bias, 6, 1, 1, True, 1.5, scoring="sqrtsoftplus",
                                      backend="triton")
    assert torch.equal(got_ids, want_ids) and torch.equal(got_w, want_w), f"seed {SEED}"
    ref_w, ref_ids = select_experts(logits, bias, 6, 1, 1, True, 1.5, scoring="sqrtsoftplus", backend="reference")
    assert (got_ids == ref_ids).all(1).float().mean() >= 0.995, f"seed {SEED}"


@pytest.mark.gpu
def test_routing_on_gpu_matches_and_never_syncs():
    g = generator(2)
    logits, bias = tied_logits(300, 256, g), torch.randn(256, generator=g) * 0.01
    check_routing(logits.cuda(), bias.cuda(), 8, 8, 4)
    logits, bias = logits.cuda(), bias.cuda()
    torch.cuda.set_sync_debug_mode("error")
    try:
        select_experts(logits, bias, 8, 8, 4, True, 2.5)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("change, message", [
    (dict(router_logits=torch.zeros(2, 8).double()), "router_logits must be fp32 (or bf16/fp16) [T, E]"),
    (dict(bias=torch.zeros(7)), "bias must be fp32 (or bf16/fp16) [E=8]"),
    (dict(bias=torch.zeros(8, dtype=torch.int32)), "bias must be fp32 (or bf16/fp16) [E=8]"),
    (dict(n_group=3), "n_group (3) must divide the number of experts (8)"),
    (dict(n_group=0), "n_group must be an int in [1, 8]"),
    (dict(topk_group=5), "topk_group must be an int in [1, 4]"),
    (dict(top_k=5), "top_k must be an int in [1, 4]"),
    (dict(top_k=True), "top_k must be an int"),
    (dict(n_group=8, topk_group=2, top_k=2), "groups of 1 are too small"),
    (dict(norm_topk_prob=1), "norm_topk_prob must be a bool"),
    (dict(routed_scaling_factor=float("nan")), "routed_scaling_factor must be a finite number"),
])
def test_bad_arguments_name_themselves(change, message):
    args = dict(router_logits=torch.zeros(2, 8), bias=torch.zeros(8), top_k=2, n_group=4, topk_group=2,
                norm_topk_prob=True, routed_scaling_factor=1.0) | change
    with pytest.raises(ValueError) as e:
        select_experts(**args)
    assert message in str(e.value)


if __name__ == "__main__":
    kernel_test_main(triton_cases, lambda: test_triton_routing_equals_reference_on_gpu(128))
