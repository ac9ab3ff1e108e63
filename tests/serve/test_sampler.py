"""Sampler: each filter and penalty against a direct computation, seeds, logprobs."""

import math

import pytest
import torch

from flashdsa.runtime.sampler import (
    apply_logit_bias,
    apply_penalties,
    filter_top_k_top_p_min_p,
    sample,
    sample_each,
    sampled_logprobs,
)
from flashdsa.runtime.sampling_params import SamplingParams
from flashdsa.runtime.sequence import Sequence

V = 50


def seq(prompt=(1, 2, 3), output=(), eos=None, **params):
    s = Sequence("r", list(prompt), SamplingParams(**params), max_tokens=100, eos_token_id=eos)
    for t in output:
        s.append_token(t)
    return s


def logits_row(seed=0):
    return torch.randn(1, V, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_rows_take_the_argmax_next_to_sampled_rows():
    logits = torch.cat([logits_row(i) for i in range(4)])
    seqs = [seq(temperature=0), seq(temperature=1.0, seed=1), seq(temperature=0), seq(top_k=1)]
    tokens = sample(logits, seqs)
    assert tokens[[0, 2, 3]].tolist() == logits.argmax(1)[[0, 2, 3]].tolist()


def test_top_k_keeps_exactly_the_k_largest():
    logits = logits_row()
    kept = filter_top_k_top_p_min_p(logits.clone(), [seq(top_k=5)]).isfinite()
    assert kept.sum() == 5 and set(kept[0].nonzero().flatten().tolist()) == set(logits[0].topk(5).indices.tolist())


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    logits = logits_row(3)
    probs = logits.softmax(1)[0]
    order = probs.argsort(descending=True)
    need = int((probs[order].cumsum(0) < 0.7).sum()) + 1
    kept = filter_top_k_top_p_min_p(logits.clone(), [seq(top_p=0.7)]).isfinite()[0]
    assert set(kept.nonzero().flatten().tolist()) == set(order[:need].tolist())


def test_min_p_drops_tokens_below_a_fraction_of_the_best():
    logits = logits_row(4)
    probs = logits.softmax(1)[0]
    kept = filter_top_k_top_p_min_p(logits.clone(), [seq(min_p=0.2)]).isfinite()[0]
    assert torch.equal(kept, probs >= 0.2 * probs.max())


def test_penalties_match_their_definitions():
    logits = logits_row(5)
    s = seq(prompt=(1, 2), output=(2, 3, 3), repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    got = apply_penalties(logits.clone(), [s])[0]
    want = logits[0].clone()
    for t in (1, 2, 3):
        want[t] = want[t] / 2 if want[t] > 0 else want[t] * 2
    want[2] -= 0.5 + 0.25
    want[3] -= 0.5 + 0.5
    torch.testing.assert_close(got, want)


def test_min_tokens_forbids_eos_and_stop_ids_until_reached():
    logits = torch.zeros(1, V)
    logits[0, 7] = 100.0
    logits[0, 9] = 90.0
    early = seq(output=(5,), eos=7, min_tokens=3, stop_token_ids=[9], temperature=0)
    assert sample(logits, [early]).item() not in (7, 9)
    done = seq(output=(5, 5, 5), eos=7, min_tokens=3, temperature=0)
    assert sample(logits, [done]).item() == 7


def test_seeded_rows_do_not_depend_on_the_batch():
    logits = torch.cat([logits_row(i) for i in range(3)])
    alone = [sample(logits[1:2], [seq(temperature=1.0, seed=11)]).item() for _ in range(1)]
    runs = [sample(logits, [seq(temperature=1.0), seq(temperature=1.0, seed=11), seq(temperature=0.5)])[1].item()
            for _ in range(3)]
    assert runs == alone * 3


def test_sampling_follows_the_distribution():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
    s = seq(temperature=1.0, seed=0)
    counts = torch.bincount(torch.tensor([sample(logits, [s]).item() for _ in range(3000)]), minlength=3)
    assert torch.allclose(counts / 3000, torch.tensor([0.5, 0.3, 0.2]), atol=0.04)


def test_logprobs_are_the_raw_log_softmax_with_rank_and_top():
    logits = logits_row(6)
    s = seq(logprobs=3, temperature=0, repetition_penalty=1.5, output=(4,))
    token = logits.argmax(1)
    (lp,) = sampled_logprobs(logits, token, [s])
    raw = logits.log_softmax(1)[0]
    assert lp.token_id == token.item() and lp.rank == 1
    assert math.isclose(lp.logprob, raw[token].item(), rel_tol=1e-6)
    assert list(lp.top) == raw.topk(3).indices.tolist()
    assert sampled_logprobs(logits, token, [seq()]) == [None]


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_p=0), dict(top_k=-2), dict(min_p=1.5),
                                 dict(max_tokens=-1), dict(max_tokens=0), dict(n=0), dict(logprobs=21), dict(min_tokens=5, max_tokens=2),
                                 dict(presence_penalty=3), dict(repetition_penalty=0), dict(seed=-1),
                                 dict(top_k=2**63), dict(seed=2**63), dict(temperature=math.nan),
                                 dict(top_p=math.nan), dict(repetition_penalty=math.inf), dict(max_tokens=2**64),
                                 dict(logit_bias={5: 100.5}), dict(logit_bias={-1: 1.0}), dict(logit_bias={5: math.nan}),
                                 dict(stop_token_ids=[2**63]), dict(n=1.5)])
def test_out_of_range_parameters_are_refused(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        SamplingParams(**bad)


def test_logit_bias_is_added_to_its_own_row_only():
    logits = torch.cat([logits_row(i) for i in range(3)])
    seqs = [seq(), seq(logit_bias={4: 100.0, 7: -3.5}), seq(logit_bias={4: -100.0})]
    biased = logits.clone()
    apply_logit_bias(biased, seqs)
    want = logits.clone()
    want[1, 4] += 100.0
    want[1, 7] -= 3.5
    want[2, 4] -= 100.0
    torch.testing.assert_close(biased, want)
    assert sample(logits[1:2], seqs[1:2]).item() == 4  # +100 dominates any sample
    apply_logit_bias(biased, seqs)  # the request's tensors are built once and reused
    assert seqs[1].sampler_tensors["logit_bias"][0].tolist() == [4, 7]


def test_top_k_above_the_vocabulary_keeps_every_token():
    logits = logits_row(7)
    kept = filter_top_k_top_p_min_p(logits.clone(), [seq(top_k=2**63 - 1)])
    torch.testing.assert_close(kept, logits)


def test_a_row_that_breaks_the_sampler_fails_alone():
    logits = torch.cat([logits_row(i) for i in range(3)])
    seqs = [seq(temperature=0.5, seed=1), seq(temperature=0.5), seq(temperature=0, logprobs=1)]
    seqs[1].params.logit_bias = {V + 5: 1.0}  # slipped past the engine's check: outside the vocabulary
    with pytest.raises(IndexError):
        sample(logits, seqs)
    results = sample_each(logits, seqs)
    assert isinstance(results[1], Exception)
    assert results[0][0] == sample(logits[:1], [seq(temperature=0.5, seed=1)]).item()
    token, lp = results[2]
    assert token == logits[2].argmax().item() and lp.rank == 1


@pytest.mark.gpu
def test_the_sampler_on_cuda_matches_the_cpu_with_bias_masks_and_seeds():
    """logit_bias, min_tokens and seeded rows on the device give the CPU's tokens; the requests'
    tensors are built on the device once and reused on the next step."""
    logits = torch.cat([logits_row(i) for i in range(4)])

    def batch():
        return [
            seq(temperature=0, logit_bias={3: 50.0, 9: -100.0}),
            seq(output=(5,), eos=7, min_tokens=3, stop_token_ids=[2], temperature=0),
            seq(temperature=0.7, seed=5, top_k=2**40),
            seq(temperature=0),
        ]

    on_cpu, on_gpu = batch(), batch()
    want = [sample(logits, on_cpu).tolist() for _ in range(2)]
    got = [sample(logits.cuda(), on_gpu).tolist() for _ in range(2)]
    assert got == want
    assert on_gpu[0].sampler_tensors["logit_bias"][0].device.type == "cuda"
