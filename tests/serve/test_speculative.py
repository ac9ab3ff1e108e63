"""Speculative decoding with the MTP layer: greedy output unchanged, sampled output distributed
as the main model's (exact rejection sampling), no leaked blocks."""

import json

import pytest
import torch

from flashdsa.models.tiny import make_tiny_checkpoint
from flashdsa.runtime.llm import LLM
from flashdsa.runtime.sampling_params import SamplingParams
from flashdsa.runtime.sequence import Sequence
from flashdsa.runtime.speculative import sample_bonus, verify_drafts, verify_on_device


@pytest.fixture(scope="module")
def mtp_checkpoint(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("mtp"), shrink=True, seed=7, mtp=True)


def _prompts(n):
    head = [(11 * i) % 300 + 4 for i in range(130)]  # two full blocks shared by all
    return [head + [(i * 17 + j) % 300 + 4 for j in range(3 + 7 * i)] for i in range(n)]


def test_greedy_output_is_identical_with_and_without_speculation(mtp_checkpoint):
    options = dict(mode="reference", num_blocks=10, max_num_seqs=6, max_num_batched_tokens=96)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=2)
    prompts = _prompts(8)
    plain = LLM(mtp_checkpoint, **options).generate(prompts, params, use_tqdm=False)
    llm = LLM(mtp_checkpoint, speculative_tokens=1, **options)
    spec = llm.generate(prompts, params, use_tqdm=False)
    engine = llm.engine
    for a, b in zip(plain, spec):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        assert [lp.token_id for lp in b.outputs[0].logprobs] == b.outputs[0].token_ids
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert y.logprob == pytest.approx(x.logprob, abs=1e-4)
    assert engine.num_draft_tokens > 0 and 0 <= engine.num_accepted_tokens <= engine.num_draft_tokens
    assert engine.scheduler.num_preemptions > 0  # chunked prefill, prefix hits and preemption all ran
    assert engine.block_manager.num_used_blocks == 0


def test_device_verification_matches_the_general_path(mtp_checkpoint, monkeypatch):
    """Plain greedy decode steps verify and draft on the device (one read-back); with logprobs
    asked the general path runs. Both give the same tokens and accept the same drafts."""
    from flashdsa.runtime import speculative as speculative_module

    calls = []
    verify = speculative_module.verify_on_device
    monkeypatch.setattr(speculative_module, "verify_on_device", lambda *a: calls.append(1) or verify(*a))
    options = dict(mode="reference", num_blocks=10, max_num_seqs=6, max_num_batched_tokens=96, speculative_tokens=1)
    prompts = _prompts(8)
    results = {}
    for logprobs in (None, 1):
        llm = LLM(mtp_checkpoint, **options)
        params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=logprobs)
        outs = llm.generate(prompts, params, use_tqdm=False)
        results[logprobs] = ([o.outputs[0].token_ids for o in outs], llm.engine.num_draft_tokens,
                             llm.engine.num_accepted_tokens)
        assert llm.engine.block_manager.num_used_blocks == 0
        if logprobs is None:
            assert calls, "no step took the device path"
            calls.clear()
    assert not calls  # logprobs: the general path only
    assert results[None] == results[1]


def test_stop_strings_and_n_with_speculation(mtp_checkpoint):
    options = dict(mode="reference", num_blocks=16)
    greedy = dict(temperature=0, max_tokens=30, ignore_eos=True)
    prompt = _prompts(1)[0]
    want = LLM(mtp_checkpoint, **options).generate([prompt], SamplingParams(**greedy), use_tqdm=False)[0].outputs[0]
    llm = LLM(mtp_checkpoint, speculative_tokens=1, **options)
    stop_id = want.token_ids[5]
    got = llm.generate([prompt], SamplingParams(stop_token_ids=[stop_id], **greedy), use_tqdm=False)[0].outputs[0]
    assert got.token_ids == want.token_ids[: want.token_ids.index(stop_id) + 1]
    stop = want.text[8:11]
    got = llm.generate([prompt], SamplingParams(stop=[stop], **greedy), use_tqdm=False)[0].outputs[0]
    assert got.text == want.text[: want.text.index(stop)] and got.finish_reason == "stop"
    sampled = SamplingParams(temperature=1.0, n=3, max_tokens=17, ignore_eos=True, seed=4)
    outs = llm.generate([prompt], sampled, use_tqdm=False)[0].outputs
    assert [len(c.token_ids) for c in outs] == [17, 17, 17] and all(c.finish_reason == "length" for c in outs)
    assert llm.engine.block_manager.num_used_blocks == 0


def test_speculation_without_an_mtp_layer_is_refused(shrunk_plain, mtp_checkpoint):
    with pytest.raises(ValueError, match="no multi-token-prediction layer"):
        LLM(shrunk_plain, mode="reference", speculative_tokens=1)
    from flashdsa.models.loader import load_model
    from flashdsa.runtime.engine import EngineConfig, LLMEngine

    with pytest.raises(ValueError, match="needs the model's multi-token-prediction layer"):
        LLMEngine(load_model(mtp_checkpoint, mode="reference"), None, EngineConfig(speculative_tokens=1))
    with pytest.raises(ValueError, match="speculative_tokens must be 0 or 1"):
        LLM(mtp_checkpoint, mode="reference", speculative_tokens=2)


@pytest.fixture(scope="module")
def shrunk_plain(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("plain"), shrink=True, seed=1)


def _seqs(n, seed, **params):
    out = []
    for i in range(n):
        seq = Sequence(str(i), [1, 2, 3], SamplingParams(seed=seed + i, **params), max_tokens=10)
        out.append(seq)
    return out


@pytest.mark.parametrize("params", [dict(temperature=1.0), dict(temperature=0.7, top_k=5)])
def test_rejection_sampling_reproduces_the_target_distribution(params):
    """Over many seeded draws with every possible draft (good and bad), the first token follows the
    sampler's distribution p, and the bonus token after an accepted draft follows its row's."""
    vocab, draws = 8, 6000
    gen = torch.Generator().manual_seed(0)
    first, second = torch.randn(vocab, generator=gen) * 1.5, torch.randn(vocab, generator=gen) * 1.5
    seqs = _seqs(draws, 100, **params)
    target = _target(first, seqs[0])
    drafts = [i % vocab for i in range(draws)]
    tokens, accepted = verify_drafts(first.expand(draws, vocab).clone(), seqs, drafts)
    assert torch.equal(accepted, tokens == torch.tensor(drafts))
    for d in range(vocab):  # whatever the draft, t_n ~ p
        rows = torch.arange(d, draws, vocab)
        counts = torch.bincount(tokens[rows], minlength=vocab).float()
        _assert_matches(counts, target)
    acc_rate = accepted.float().mean().item()  # P(accept) = E_d[p(d)] = 1 / vocab for uniform drafts
    assert abs(acc_rate - 1 / vocab) < 4 * (1 / vocab / draws) ** 0.5
    won = accepted.nonzero()[:, 0].tolist()
    bonus = sample_bonus(second.expand(len(won), vocab).clone(), [seqs[j] for j in won], [drafts[j] for j in won])
    assert all(len(seqs[j]) == 3 for j in won)  # the draft was only borrowed
    _assert_matches(torch.bincount(bonus, minlength=vocab).float(), _target(second, seqs[0]))


class _Runner:
    """What verify_on_device asks of the model runner: the step's flat input ids [t_0, d_0, ...]
    and the MTP layer's logits for its next drafts (a constant here)."""

    def __init__(self, drafts: list[int]):
        self.flat = torch.tensor([x for d in drafts for x in (0, d)])

    def last_input_ids(self) -> torch.Tensor:
        return self.flat

    def draft(self, picks: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        return torch.zeros(rows.numel(), 4)

    def verdict_buffer(self, numel: int) -> None:
        return None  # no decode graphs: a new tensor


@pytest.mark.parametrize("params", [dict(temperature=1.0), dict(temperature=0.7, top_p=0.9)])
def test_device_verification_of_sampled_requests_reproduces_the_target_distribution(params):
    """The on-device path (unseeded sampled requests, overlapped under async scheduling): whatever
    the draft, t_n follows p; the t_{n+1} kept after an accepted draft follows its row's; greedy
    rows in the same step take their argmaxes."""
    vocab, draws = 8, 6000
    gen = torch.Generator().manual_seed(1)
    first, second = torch.randn(vocab, generator=gen) * 1.5, torch.randn(vocab, generator=gen) * 1.5
    seqs = [Sequence(str(i), [1, 2, 3], SamplingParams(**params), max_tokens=10) for i in range(draws)]
    seqs[0] = Sequence("greedy", [1, 2, 3], SamplingParams(temperature=0), max_tokens=10)
    assert all(s.generator is None for s in seqs)
    drafts = [i % vocab for i in range(draws)]
    logits = torch.stack([first, second]).repeat(draws, 1)  # rows [t_n, t_{n+1}] of each chunk
    torch.manual_seed(5)
    verdict = verify_on_device(_Runner(drafts), logits, seqs)
    picks = verdict.picks.view(-1, 2)
    assert picks[0, 0] == first.argmax() and picks[0, 1] == second.argmax()
    assert torch.equal(verdict.accepted, picks[:, 0] == torch.tensor(drafts))
    tokens, kept = picks[1:, 0], picks[1:, 1][verdict.accepted[1:]]
    for d in range(vocab):
        _assert_matches(torch.bincount(tokens[torch.arange(d + vocab - 1, draws - 1, vocab)], minlength=vocab).float(),
                        _target(first, seqs[1]))
    rate = verdict.accepted[1:].float().mean().item()  # E_d[p(d)] = 1 / vocab for uniform drafts
    assert abs(rate - 1 / vocab) < 4 * (1 / vocab / draws) ** 0.5
    _assert_matches(torch.bincount(kept, minlength=vocab).float(), _target(second, seqs[1]))


def test_greedy_verification_accepts_exactly_the_argmax():
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0], [0.0, 0.0, 5.0]])
    seqs = _seqs(3, 0, temperature=0.0)
    tokens, accepted = verify_drafts(logits, seqs, [1, 2, None])
    assert tokens.tolist() == [1, 0, 2] and accepted.tolist() == [True, False, False]


def _target(logits, seq):
    from flashdsa.runtime.sampler import adjust_logits, sampling_probs

    return sampling_probs(adjust_logits(logits[None], [seq]), [seq])[0]


def _assert_matches(counts, probs):
    """Chi-square goodness of fit at ~1e-4 significance over the tokens with expected count >= 5."""
    n = counts.sum()
    expected = probs * n
    keep = expected >= 5
    assert counts[~keep].sum() <= max(10.0, 3 * expected[~keep].sum())
    chi2 = ((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum().item()
    dof = int(keep.sum()) - 1
    assert chi2 < dof + 8 * (2 * dof) ** 0.5 + 10, (chi2, dof, counts, expected)


def test_metrics_count_draft_and_accepted_tokens(mtp_checkpoint):
    from flashdsa.serve.metrics import ServerMetrics

    llm = LLM(mtp_checkpoint, mode="reference", num_blocks=8, speculative_tokens=1)
    llm.generate([_prompts(1)[0]], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    engine = llm.engine
    text = ServerMetrics(engine).render().decode()
    assert f"flashdsa:spec_decode_num_draft_tokens_total {float(engine.num_draft_tokens)}" in text
    assert f"flashdsa:spec_decode_num_accepted_tokens_total {float(engine.num_accepted_tokens)}" in text
    assert engine.num_draft_tokens >= 5


def test_server_streams_the_same_greedy_text_with_speculation_and_counts_drafts(mtp_checkpoint):
    import httpx
    from server_thread import ServerThread, metric, wait_until_idle
    from transformers import AutoTokenizer

    from flashdsa.models.loader import load_model
    from flashdsa.runtime.engine import EngineConfig
    from flashdsa.serve.command import make_app

    tokenizer = AutoTokenizer.from_pretrained(mtp_checkpoint)
    model = load_model(mtp_checkpoint, mode="reference", mtp=True)
    body = {"model": "m", "prompt": "The sea is", "temperature": 0, "max_tokens": 12, "ignore_eos": True}
    texts = {}
    for spec in (0, 1):
        config = EngineConfig(max_num_seqs=4, num_blocks=8, max_model_len=256, speculative_tokens=spec)
        with ServerThread(make_app(model, tokenizer, "m", config)) as server:
            plain = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()
            with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
                chunks = [line for line in r.iter_lines() if line.startswith("data: {")]
            texts[spec] = plain["choices"][0]["text"]
            assert "".join(json.loads(c[6:])["choices"][0]["text"] for c in chunks) == texts[spec]
            wait_until_idle(server)
            assert (metric(server, "spec_decode_num_draft_tokens_total") > 0) == bool(spec)
            assert server.engine.block_manager.num_used_blocks == 0
    assert texts[1] == texts[0]


def test_device_verdict_packs_the_next_steps_input_ids():
    """``with_tokens`` (async scheduling): each chunk's last new token (t_{n+1} where its draft
    held, else t_n), then its next draft, as the host reads them back; the copy's layout unchanged."""
    gen = torch.Generator().manual_seed(3)
    for trial in range(10):
        n, vocab = int(torch.randint(1, 9, (1,), generator=gen)), 6
        drafts = torch.randint(0, vocab, (n,), generator=gen).tolist()
        logits = torch.randn(2 * n, vocab, generator=gen)
        logits[0::2][torch.rand(n, generator=gen) < 0.5] = 0.0  # ties: t_n = 0, so a draft of 0 holds
        runner = _Runner(drafts)
        runner.draft = lambda picks, rows: torch.nn.functional.one_hot((picks[rows] * 5 + 1) % vocab, vocab).float()
        plain = verify_on_device(runner, logits, _seqs(n, 0, temperature=0.0))
        verdict = verify_on_device(runner, logits, _seqs(n, 0, temperature=0.0), with_tokens=True)
        assert plain.tokens is None and plain.outcome == verdict.outcome
        new, next_drafts = verdict.outcome
        assert sum(len(t) == 2 for t in new) == int(verdict.accepted.sum()), trial
        assert verdict.tokens.tolist() == [t[-1] for t in new] + next_drafts, trial
        assert next_drafts == [(t[-1] * 5 + 1) % vocab for t in new], trial
