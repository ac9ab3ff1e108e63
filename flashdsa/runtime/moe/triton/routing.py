"""DeepSeek-V3 group-limited routing of one token row per Triton program (E <= 4096 in registers),
and DeepSeek-V4's hash routing (the experts a table gives each token id, one token a program).

The row is a [groups, experts per group] tile: sigmoid scores (or DeepSeek-V4's sqrt(softplus):
torch's softplus, ``x`` above 20, else libdevice's ``log1pf(expf(x))``, then a rounded square root),
the biased choice, each group's
two best, the kept groups (rank by count of better groups, ties to the lower group), then top_k
rounds of "best available expert, lowest index on ties" - the order of the reference's stable
descending sort. On a GPU the sigmoid is libdevice's ``expf`` and an IEEE division, as torch's
kernel computes it, so the experts chosen equal the reference's; the interpreter (no libdevice)
uses NumPy's exp. NaN choices count as -inf, so every id stays inside [0, E). The hash routing
reads only its token's ``top_k`` logits and scores them with the same functions. bf16/fp16 logits
are widened to fp32 as they are loaded (exact), so the router GEMM's output needs no cast kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from flashdsa.runtime.dispatch import interpreting
from flashdsa.runtime.moe.reference import NORM_EPS


@triton.jit
def torch_exp(x, LIBDEVICE: tl.constexpr):
    """fp32 ``exp(x)`` as torch's CUDA kernels compute it (libdevice's expf, not the fast ``ex2``
    approximation); NumPy's exp in the interpreter, which has no libdevice."""
    if LIBDEVICE:
        return libdevice.exp(x)
    else:
        return tl.exp(x)


@triton.jit
def _sigmoid(x, LIBDEVICE: tl.constexpr):
    """``1 / (1 + exp(-x))`` with torch's CUDA roundings (libdevice expf, IEEE division)."""
    return tl.math.div_rn(tl.full(x.shape, 1.0, tl.float32), 1.0 + torch_exp(-x, LIBDEVICE))


@triton.jit
def _sqrt_softplus(x, LIBDEVICE: tl.constexpr):
    """``sqrt(softplus(x))`` as torch computes it (softplus threshold 20). Without libdevice (the
    interpreter) log1p(y) is log(1 + y) * y / ((1 + y) - 1), accurate for tiny y."""
    if LIBDEVICE:
        soft = libdevice.log1p(libdevice.exp(x))
    else:
        y = tl.exp(x)
        u = 1.0 + y
        soft = tl.where(u == 1.0, y, tl.log(u) * (y / (u - 1.0)))
    return tl.sqrt_rn(tl.where(x > 20.0, x, soft))


@triton.jit
def _route_kernel(logits_ptr, bias_ptr, weights_ptr, ids_ptr, stride_l, scaling, norm_eps, n_group, per_group,
                  TOPK_GROUP: tl.constexpr, TOP_K: tl.constexpr, GROUPED: tl.constexpr, NORMALIZE: tl.constexpr,
                  G_BLOCK: tl.constexpr, P_BLOCK: tl.constexpr, K_BLOCK: tl.constexpr, LIBDEVICE: tl.constexpr,
                  SQRT_SOFTPLUS: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    g = tl.arange(0, G_BLOCK)
    p = tl.arange(0, P_BLOCK)[None, :]
    inside = (g[:, None] < n_group) & (p < per_group)
    expert = g[:, None] * per_group + p  # [G, P]
    logits = tl.load(logits_ptr + t * stride_l + expert, mask=inside, other=0.0).to(tl.float32)
    if SQRT_SOFTPLUS:
        scores = _sqrt_softplus(logits, LIBDEVICE)
    else:
        scores = _sigmoid(logits, LIBDEVICE)
    choice = scores + tl.load(bias_ptr + expert, mask=inside, other=0.0)
    choice = tl.where(inside & (choice == choice), choice, float("-inf"))
    if GROUPED:  # keep the TOPK_GROUP groups with the largest sum of their two best choices
        best = tl.max(choice, axis=1)
        first = tl.min(tl.where(inside & (choice == best[:, None]), p, P_BLOCK), axis=1)
        second = tl.max(tl.where(p == first[:, None], float("-inf"), choice), axis=1)
        group_score = best + second  # [G]
        other = g[None, :]
        better = (group_score[None, :] > group_score[:, None]) | \
            ((group_score[None, :] == group_score[:, None]) & (other < g[:, None]))
        rank = tl.sum((better & (other < n_group)).to(tl.int32), axis=1)
        choice = tl.where((rank < TOPK_GROUP)[:, None], choice, float("-inf"))
    available = inside
    k = tl.arange(0, K_BLOCK)
    ids = tl.zeros([K_BLOCK], tl.int32)
    weights = tl.zeros([K_BLOCK], tl.float32)
    total = 0.0
    for j in tl.static_range(TOP_K):
        top = tl.max(tl.max(tl.where(available, choice, float("-inf")), axis=1), axis=0)
        pick = tl.min(tl.min(tl.where(available & (choice == top), expert, 1 << 30), axis=1), axis=0)
        hit = expert == pick
        score = tl.sum(tl.sum(tl.where(hit, scores, 0.0), axis=1), axis=0)  # the one chosen score, exactly
        available = available & ~hit
        ids = tl.where(k == j, pick, ids)
        weights = tl.where(k == j, score, weights)
        total += score  # left to right over the chosen experts
    if NORMALIZE:
        weights = tl.math.div_rn(weights, tl.full([K_BLOCK], total + norm_eps, tl.float32))
    tl.store(weights_ptr + t * TOP_K + k, weights * scaling, mask=k < TOP_K)
    tl.store(ids_ptr + t * TOP_K + k, ids, mask=k < TOP_K)


@triton.jit
def _hash_route_kernel(logits_ptr, table_ptr, tokens_ptr, weights_ptr, ids_ptr, stride_l, num_experts, vocab,
                       scaling, norm_eps, TOP_K: tl.constexpr, K_BLOCK: tl.constexpr, LIBDEVICE: tl.constexpr,
                       SQRT_SOFTPLUS: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    k = tl.arange(0, K_BLOCK)
    token = tl.load(tokens_ptr + t).to(tl.int64)
    known = (token >= 0) & (token < vocab)  # an id outside the table routes nowhere
    entry = tl.load(table_ptr + token * TOP_K + k, mask=known & (k < TOP_K), other=-1)
    valid = (entry >= 0) & (entry < num_experts)  # an entry outside [0, E) is -1, never dereferenced
    ids = tl.where(valid, entry, -1).to(tl.int32)
    logits = tl.load(logits_ptr + t * stride_l + ids, mask=valid, other=0.0).to(tl.float32)
    if SQRT_SOFTPLUS:
        scores = _sqrt_softplus(logits, LIBDEVICE)
    else:
        scores = _sigmoid(logits, LIBDEVICE)
    scores = tl.where(valid, scores, 0.0)
    weights = tl.math.div_rn(scores, tl.full([K_BLOCK], tl.sum(scores, axis=0) + norm_eps, tl.float32))
    tl.store(weights_ptr + t * TOP_K + k, weights * scaling, mask=k < TOP_K)
    tl.store(ids_ptr + t * TOP_K + k, ids, mask=k < TOP_K)


def hash_experts(router_logits: torch.Tensor, tid2eid: torch.Tensor, input_ids: torch.Tensor,
                 routed_scaling_factor: float, scoring: str = "sqrtsoftplus") -> tuple[torch.Tensor, torch.Tensor]:
    tokens, top_k = input_ids.shape[0], tid2eid.shape[1]
    weights = torch.empty(tokens, top_k, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(tokens, top_k, dtype=torch.int32, device=router_logits.device)
    if tokens == 0:
        return weights, ids
    _hash_route_kernel[(tokens,)](router_logits, tid2eid, input_ids, weights, ids, router_logits.stride(0),
                                  router_logits.shape[1], tid2eid.shape[0], routed_scaling_factor, NORM_EPS,
                                  TOP_K=top_k, K_BLOCK=triton.next_power_of_2(top_k), LIBDEVICE=not interpreting(),
                                  SQRT_SOFTPLUS=scoring == "sqrtsoftplus", num_warps=1)
    return weights, ids


def select_experts(router_logits: torch.Tensor, bias: torch.Tensor, top_k: int, n_group: int, topk_group: int,
                   norm_topk_prob: bool, routed_scaling_factor: float,
                   scoring: str = "sigmoid") -> tuple[torch.Tensor, torch.Tensor]:
    tokens, experts = router_logits.shape
    weights = torch.empty(tokens, top_k, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(tokens, top_k, dtype=torch.int32, device=router_logits.device)
    if tokens == 0:
        return weights, ids
    per_group = experts // n_group
    _route_kernel[(tokens,)](router_logits, bias, weights, ids, router_logits.stride(0), routed_scaling_factor,
                             NORM_EPS, n_group, per_group, TOPK_GROUP=topk_group, TOP_K=top_k, GROUPED=topk_group < n_group,
                             NORMALIZE=norm_topk_prob, G_BLOCK=triton.next_power_of_2(n_group),
                             P_BLOCK=triton.next_power_of_2(per_group), K_BLOCK=triton.next_power_of_2(top_k),
                             LIBDEVICE=not interpreting(), SQRT_SOFTPLUS=scoring == "sqrtsoftplus", num_warps=4)
    return weights, ids
