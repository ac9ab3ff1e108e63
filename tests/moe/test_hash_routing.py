"""hash_experts (reference and triton backends) against a per-token NumPy re-statement of
DeepSeek-V4's hash routing; the triton kernel runs under TRITON_INTERPRET=1 on CPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flashdsa.runtime.moe import hash_experts
from flashdsa.runtime.moe.reference import routing_scores
from flashdsa.testing import flood_cuda_allocator_with_nan, kernel_test_main, poisoned_empty, run_under_interpreter
from moe_cases import SEED, assert_sync_free_and_replayable, generator

V4_FLASH = dict(experts=256, top_k=6, vocab=129280)  # DeepSeek-V4-Flash's router and vocabulary


def restated(scores: torch.Tensor, table: torch.Tensor, token_ids: torch.Tensor,
             factor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Token by token: the table row of the token id (every entry -1 for an id outside the
    table; an entry outside [0, E) -1), weights the rows' scores over their sum, in float64."""
    scores, table, token_ids = scores.cpu().numpy(), table.cpu().numpy(), token_ids.cpu().numpy()
    vocab, top_k = table.shape
    experts = scores.shape[1]
    all_ids, all_weights = [], []
    for s, token in zip(scores, token_ids):
        row = table[token] if 0 <= token < vocab else np.full(top_k, -1)
        ids = [int(e) if 0 <= e < experts else -1 for e in row]
        w = np.array([s[e] if e >= 0 else 0.0 for e in ids], dtype=np.float64)
        all_ids.append(ids)
        all_weights.append(w / (w.sum() + 1e-20) * factor)
    shape = (len(token_ids), top_k)
    return (torch.tensor(np.array(all_weights).reshape(shape)),
            torch.tensor(all_ids, dtype=torch.int32).view(shape))


def check_hash_routing(logits, table, token_ids, factor=1.5, scoring="sqrtsoftplus", backend=None) -> None:
    flood_cuda_allocator_with_nan(logits.device)
    with poisoned_empty():
        weights, ids = hash_experts(logits, table, token_ids, factor, scoring=scoring, backend=backend)
    want_weights, want_ids = restated(routing_scores(logits, scoring), table, token_ids, factor)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    differ = int((ids.cpu() != want_ids).sum())
    assert differ == 0, f"seed {SEED}: experts differ in {differ} places"
    torch.testing.assert_close(weights.cpu().double(), want_weights, rtol=1e-6, atol=1e-7, msg=f"seed {SEED}")


def random_table(vocab: int, experts: int, top_k: int, g: torch.Generator, distinct: bool = True) -> torch.Tensor:
    """int64 [V, k]: k distinct experts a row (as trained), or drawn with repeats."""
    if distinct:
        return torch.rand(vocab, experts, generator=g).argsort(-1)[:, :top_k].contiguous()
    return torch.randint(0, experts, (vocab, top_k), generator=g)


CASES = [  # tokens, experts, top_k, vocab
    (7, 256, 6, 50),  # V4-Flash's router widths
    (5, 16, 3, 11),  # top_k not a power of two
    (9, 64, 8, 9),  # every token id of the table once (below)
    (1, 1, 1, 1),
]


@pytest.mark.parametrize("tokens, experts, top_k, vocab", CASES)
@pytest.mark.parametrize("scoring", ["sqrtsoftplus", "sigmoid", "softmax"])
def test_hash_routing_matches_the_restated_math(tokens, experts, top_k, vocab, scoring, backend=None):
    """Random logits (some past softplus's threshold of 20), every token id of the table."""
    g = generator(tokens, experts, top_k, vocab, len(scoring))
    logits = torch.randn(tokens, experts, generator=g) * 4
    logits[0, :3] = torch.tensor([25.0, -30.0, 20.5])[:experts]
    token_ids = torch.arange(tokens) % vocab
    check_hash_routing(logits, random_table(vocab, experts, top_k, g), token_ids, scoring=scoring, backend=backend)


def test_tied_scores_and_repeated_experts_keep_the_table_order(backend=None):
    """Logits from 3 values (tied scores) and a table that may name one expert twice in a row:
    ids in the table's order, equal scores equal weights, a repeated expert weighted twice."""
    g = generator(11)
    experts, top_k, vocab = 12, 4, 30
    logits = torch.randint(-1, 2, (40, experts), generator=g).float()
    table = random_table(vocab, experts, top_k, g, distinct=False)
    table[0] = torch.tensor([5, 5, 5, 5])
    token_ids = torch.randint(0, vocab, (40,), generator=g)
    token_ids[0] = 0
    check_hash_routing(logits, table, token_ids, backend=backend)


def test_every_expert_of_the_table_and_int32_inputs(backend=None):
    """Each expert id in [0, E) appears in the table (rows are shifted ranges), int32 table and ids,
    and strided logits rows (a view into a wider buffer)."""
    g = generator(12)
    experts, top_k = 20, 5
    table = (torch.arange(experts)[:, None] + torch.arange(top_k)) % experts  # V = E rows
    wide = torch.randn(experts, experts + 7, generator=g) * 3
    check_hash_routing(wide[:, 3:3 + experts], table.int(), torch.randperm(experts, generator=g).int(),
                       backend=backend)


def test_ids_outside_the_table_or_the_experts_route_nowhere(backend=None):
    """A token id < 0 or >= V gets -1 ids and zero weights; a table entry < 0 or >= E gets -1 and
    weight 0 while the row's other experts share the whole weight."""
    g = generator(13)
    experts, top_k, vocab = 8, 3, 6
    table = random_table(vocab, experts, top_k, g)
    table[2, 1], table[4, 0], table[5] = experts, -3, torch.tensor([-1, 9, 2**40])
    token_ids = torch.tensor([-1, vocab, 2, 4, 5, 0, 2**35])
    check_hash_routing(torch.randn(7, experts, generator=g), table, token_ids, backend=backend)


def test_no_tokens():
    weights, ids = hash_experts(torch.zeros(0, 16), torch.zeros(4, 2, dtype=torch.int64),
                                torch.zeros(0, dtype=torch.int64), 1.0)
    assert weights.shape == ids.shape == (0, 2)


def test_triton_hash_routing_takes_sqrtsoftplus_and_sigmoid_not_softmax():
    from flashdsa.runtime.moe import _triton_hash_routes

    assert _triton_hash_routes(6, "sqrtsoftplus") is None and _triton_hash_routes(6, "sigmoid") is None
    assert "sigmoid or sqrtsoftplus, got softmax" in _triton_hash_routes(6, "softmax")
    assert "top_k <= 64" in _triton_hash_routes(65, "sigmoid")


@pytest.mark.parametrize("change, message", [
    (dict(router_logits=torch.zeros(2, 8).double()), "router_logits must be fp32 (or bf16/fp16) [T, E]"),
    (dict(router_logits=torch.zeros(8, 2).T), "router_logits must have contiguous rows"),
    (dict(tid2eid=torch.zeros(5, 2)), "tid2eid must be int64/int32 [V, top_k]"),
    (dict(tid2eid=torch.zeros(5, 0, dtype=torch.int64)), "tid2eid must be int64/int32 [V >= 1, top_k >= 1]"),
    (dict(input_ids=torch.zeros(3, dtype=torch.int64)), "input_ids must be int64/int32 [T=2]"),
    (dict(input_ids=torch.zeros(2, 1, dtype=torch.int64)), "input_ids must be int64/int32 [T=2]"),
    (dict(routed_scaling_factor=float("inf")), "routed_scaling_factor must be a finite number"),
    (dict(scoring="tanh"), "scoring must be one of"),
])
def test_bad_arguments_name_themselves(change, message):
    args = dict(router_logits=torch.zeros(2, 8), tid2eid=torch.zeros(5, 2, dtype=torch.int64),
                input_ids=torch.zeros(2, dtype=torch.int64), routed_scaling_factor=1.0) | change
    scoring = args.pop("scoring", "sqrtsoftplus")
    with pytest.raises(ValueError) as e:
        hash_experts(**args, scoring=scoring)
    assert message in str(e.value)


def test_reference_is_differentiable_in_the_logits():
    """Fine-tuning routes through the reference: the weights carry the logits' gradient."""
    g = generator(14)
    logits = torch.randn(4, 16, generator=g, requires_grad=True)
    weights, _ = hash_experts(logits, random_table(10, 16, 3, g), torch.tensor([0, 3, 9, 3]), 1.5, backend="reference")
    (weights * torch.arange(3.0)).sum().backward()
    assert logits.grad is not None and logits.grad.abs().sum() > 0


def test_bf16_logits_route_as_their_fp32_widening(backend=None):
    """A bf16 router GEMM's output goes in as it is (no cast kernel): the same experts and bit-equal
    weights as its exact fp32 widening, strided rows included."""
    g = generator(16)
    logits = (torch.randn(6, 40, generator=g) * 3).bfloat16()[:, :32]
    table, token_ids = random_table(10, 32, 6, g), torch.randint(0, 10, (6,), generator=g)
    for scoring in ("sqrtsoftplus", "sigmoid"):
        got = hash_experts(logits, table, token_ids, 1.5, scoring=scoring, backend=backend)
        want = hash_experts(logits.float(), table, token_ids, 1.5, scoring=scoring, backend=backend)
        assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0]), f"seed {SEED}"


def triton_cases() -> None:
    """Every case on the triton backend (softmax is the reference's alone), bf16 logits too."""
    for case in CASES:
        for scoring in ("sqrtsoftplus", "sigmoid"):
            test_hash_routing_matches_the_restated_math(*case, scoring, backend="triton")
    test_tied_scores_and_repeated_experts_keep_the_table_order(backend="triton")
    test_every_expert_of_the_table_and_int32_inputs(backend="triton")
    test_ids_outside_the_table_or_the_experts_route_nowhere(backend="triton")
    test_bf16_logits_route_as_their_fp32_widening(backend="triton")


def test_triton_hash_routing_under_interpreter():
    run_under_interpreter(__file__, SEED)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 32, 4096])
def test_triton_hash_routing_equals_reference_on_gpu(tokens):
    """V4-Flash's widths (256 experts, top-6, its vocabulary): the same experts as torch's ops
    exactly (no choice is made), the weights within an fp32 ulp or two (the sum's order), no host
    sync, and a captured CUDA graph replays it."""
    g = generator(15, tokens)
    table = random_table(V4_FLASH["vocab"], V4_FLASH["experts"], V4_FLASH["top_k"], g).cuda()
    logits = (torch.randn(tokens, V4_FLASH["experts"], generator=g) * 3).cuda()
    token_ids = torch.randint(0, V4_FLASH["vocab"], (tokens,), generator=g).cuda()
    for scoring in ("sqrtsoftplus", "sigmoid"):
        got_w, got_ids = hash_experts(logits, table, token_ids, 1.5, scoring=scoring, backend="triton")
        want_w, want_ids = hash_experts(logits, table, token_ids, 1.5, scoring=scoring, backend="reference")
        assert torch.equal(got_ids, want_ids), f"seed {SEED}"
        torch.testing.assert_close(got_w, want_w, rtol=1e-6, atol=0, msg=f"seed {SEED}")
    check_hash_routing(logits, table, token_ids)
    assert_sync_free_and_replayable(lambda: hash_experts(logits, table, token_ids, 1.5), lambda: token_ids.copy_(
        torch.randint(0, V4_FLASH["vocab"], (tokens,), generator=g)))


if __name__ == "__main__":
    kernel_test_main(triton_cases, lambda: test_triton_hash_routing_equals_reference_on_gpu(32))
