"""Structured outputs in the engine (runtime/structured.py): grammars compiled with errors that
name their field, one token bitmask per step for a batch mixing requests with and without
grammars, applied exactly, and tokens that follow each grammar to its end."""

import json
import re

import pytest
import torch
import xgrammar as xgr
from fake_model import FakeModel, context_logits, reference_greedy

from flashdsa.runtime.engine import LLMEngine, EngineConfig
from flashdsa.runtime.sampling_params import SamplingParams
from flashdsa.runtime.structured import Grammars, StructuredOutputsParams, apply_bitmask

SCHEMA = {"type": "object", "properties": {"name": {"enum": ["ann", "bob"]}, "ok": {"type": "boolean"},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["name", "ok", "n"]}


def allowed_tokens(bitmask_row: torch.Tensor, vocab: int) -> torch.Tensor:
    """[vocab] bool from one packed bitmask row (bit t % 32 of word t // 32), the reference unpacking."""
    bits = (bitmask_row.to(torch.int64).unsqueeze(1) >> torch.arange(32)) & 1
    return bits.flatten()[:vocab].bool()


def constrained_greedy(prompt: list[int], vocab: int, matcher: xgr.GrammarMatcher, max_tokens: int) -> list[int]:
    """What greedy decoding of the fake must produce under the grammar, one token at a time."""
    ids, out = list(prompt), []
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    while len(out) < max_tokens and not matcher.is_terminated():
        matcher.fill_next_token_bitmask(bitmask)
        logits = context_logits(torch.tensor(ids), vocab)
        token = int(logits.masked_fill(~allowed_tokens(bitmask[0], vocab), float("-inf")).argmax())
        assert matcher.accept_token(token)
        out.append(token)
        ids.append(token)
    return out


def matches_schema(value) -> bool:
    return (isinstance(value, dict) and set(value) == {"name", "ok", "n"} and value["name"] in ("ann", "bob")
            and isinstance(value["ok"], bool) and isinstance(value["n"], int) and 0 <= value["n"] <= 9)


@pytest.mark.parametrize("kind, field", [
    ({}, "give exactly one"), ({"regex": "a", "choice": ["a"]}, "give exactly one"),
    ({"choice": []}, "non-empty"), ({"choice": ["a", 3]}, "non-empty"),
])
def test_params_take_exactly_one_grammar(kind, field):
    with pytest.raises(ValueError, match=f"guided_x: .*{field}"):
        StructuredOutputsParams(**kind, source="guided_x")


@pytest.mark.parametrize("kind, message", [
    ({"json": {"type": "wizard"}}, "Unsupported type"),
    ({"json": "{not json"}, "not valid JSON"),
    ({"regex": "(ab"}, "parenthesis"),
    ({"grammar": "root ::= missing"}, "not defined"),
    ({"structural_tag": {"type": "structural_tag"}}, "'format' object"),
    ({"structural_tag": {"type": "structural_tag", "format": {"type": "nope"}}}, ""),
])
def test_compile_errors_name_the_field(tok, kind, message):
    grammars = Grammars(tok, len(tok))
    with pytest.raises(ValueError, match=f"^the_field: .*{message}"):
        grammars.compile(StructuredOutputsParams(**kind, source="the_field"))


def test_min_tokens_cannot_join_a_grammar():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=2, structured_outputs=StructuredOutputsParams(regex="a+"))


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("vocab_extra", [0, 5, 37])  # model vocabularies past the tokenizer's
def test_bitmask_rows_and_apply_match_each_matcher(tok, vocab_extra, device):
    vocab, device = len(tok) + vocab_extra, torch.device(device)
    grammars = Grammars(tok, vocab)
    json_matcher = grammars.matcher(StructuredOutputsParams(json=SCHEMA))
    assert json_matcher.accept_string('{"name": "b')  # part way: only "ob" can follow
    matchers = [None, json_matcher, grammars.matcher(StructuredOutputsParams(choice=["yes", "no"])), None,
                grammars.matcher(StructuredOutputsParams(regex=r"[0-9]{2}"))]
    bitmask = grammars.bitmask(matchers, device).clone()  # valid until the next call: copy it
    assert bitmask.device.type == device.type
    bitmask = bitmask.cpu()
    assert bitmask.shape == (5, (vocab + 31) // 32) and bitmask.dtype == torch.int32
    for i, matcher in enumerate(matchers):
        if matcher is None:
            assert (bitmask[i] == -1).all()
        else:
            alone = xgr.allocate_token_bitmask(1, vocab)
            matcher.fill_next_token_bitmask(alone)
            assert torch.equal(bitmask[i], alone[0])
            assert 0 < int(allowed_tokens(bitmask[i], vocab).sum()) < len(tok)
    assert grammars.bitmask([None, None], device) is None
    again = grammars.bitmask(matchers[::-1], device)  # the rows are reused: refilled, not stale
    assert torch.equal(again.cpu(), bitmask.flip(0))
    logits = torch.randn(5, vocab, generator=torch.Generator().manual_seed(vocab))
    logits[:, ::7] = float("nan")  # poisoned entries: kept where allowed, -inf where forbidden
    masked = logits.to(device)
    apply_bitmask(masked, bitmask.to(device))
    masked = masked.cpu()
    allowed = torch.stack([allowed_tokens(row, vocab) for row in bitmask])
    want = logits.masked_fill(~allowed, float("-inf"))
    assert torch.equal(masked.isnan(), want.isnan()) and torch.equal(masked.nan_to_num(0), want.nan_to_num(0))


def run(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict:
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params)
    outputs = {request_id: {"ids": [], "text": "", "finish": None} for request_id in requests}
    while engine.has_unfinished():
        for out in engine.step():
            entry = outputs[out.request_id]
            entry["ids"] += out.new_token_ids
            entry["text"] += out.new_text
            entry["finish"] = out.finish_reason
    return outputs


def test_one_batch_mixes_grammars_and_free_text(tok):
    vocab = len(tok)
    engine = LLMEngine(FakeModel(vocab), tok, EngineConfig(num_blocks=32, max_num_seqs=8))
    grammars = {
        "json": StructuredOutputsParams(json=SCHEMA),
        "choice": StructuredOutputsParams(choice=["yes", "no", "maybe not"]),
        "regex": StructuredOutputsParams(regex=r"[a-z]{3}-[0-9]{2,4}"),
        "object": StructuredOutputsParams(json_object=True),
    }
    free = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    requests = {"free0": ([5, 6, 7], free), "free1": ([9, 8], free)}
    for i, (name, grammar) in enumerate(grammars.items()):
        requests[name] = ([10 + i, 11], SamplingParams(temperature=0, max_tokens=200, ignore_eos=i % 2 == 0,
                                                       structured_outputs=grammar))
    outputs = run(engine, requests)
    assert engine.block_manager.num_used_blocks == 0
    for name in ("free0", "free1"):  # the bitmask leaves rows without a grammar alone
        assert outputs[name]["ids"] == reference_greedy(requests[name][0], vocab, 24, eos=-1)
    for name, grammar in grammars.items():
        out = outputs[name]
        assert out["ids"] == constrained_greedy(requests[name][0], vocab, engine.grammars.matcher(grammar), 200)
        assert out["finish"] == "stop" and out["ids"][-1] == tok.eos_token_id  # the grammar ended it
        assert out["text"] == tok.decode(out["ids"][:-1], skip_special_tokens=True)
    assert matches_schema(json.loads(outputs["json"]["text"]))
    assert outputs["choice"]["text"] in ("yes", "no", "maybe not")
    assert re.fullmatch(r"[a-z]{3}-[0-9]{2,4}", outputs["regex"]["text"])
    assert isinstance(json.loads(outputs["object"]["text"]), (dict, list))


def test_sampled_choices_each_follow_the_grammar(tok):
    engine = LLMEngine(FakeModel(len(tok)), tok, EngineConfig(num_blocks=32))
    choices = ["red", "green", "blue", "dark red"]
    grammar = StructuredOutputsParams(choice=choices)
    params = SamplingParams(temperature=1.5, seed=3, max_tokens=20, structured_outputs=grammar)
    outputs = run(engine, {f"c{j}": ([4, 4, j], params.for_choice(j)) for j in range(8)})
    assert all(o["text"] in choices and o["finish"] == "stop" for o in outputs.values())
    assert len({o["text"] for o in outputs.values()}) > 1
    with pytest.raises(ValueError, match="guided_regex: cannot compile"):
        bad = StructuredOutputsParams(regex="[", source="guided_regex")
        engine.add_request("bad", [1], SamplingParams(structured_outputs=bad))
    assert not engine.has_unfinished()


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_stay_in_the_text_when_asked(tok, skip):
    """DeepSeek-V3.2's DSML marker is a special token: tool calls only parse when it is kept."""
    dsml = tok.convert_tokens_to_ids("｜DSML｜")
    tag = {"type": "structural_tag", "format": {"type": "sequence", "elements": [
        {"type": "token", "token": dsml}, {"type": "const_string", "value": "call"}]}}
    engine = LLMEngine(FakeModel(len(tok)), tok, EngineConfig(num_blocks=8))
    params = SamplingParams(temperature=0, max_tokens=20, skip_special_tokens=skip,
                            structured_outputs=StructuredOutputsParams(structural_tag=tag))
    out = run(engine, {"r": ([3, 4], params)})["r"]
    assert out["ids"][0] == dsml and out["text"] == ("call" if skip else "｜DSML｜call")


@pytest.mark.gpu
def test_default_model_on_cuda_follows_a_schema():
    from flashdsa.defaults import DEFAULT_MODEL
    from flashdsa.runtime.llm import LLM

    llm = LLM(DEFAULT_MODEL, device="cuda", mode="reference", max_num_seqs=4)
    params = [SamplingParams(temperature=t, seed=1, max_tokens=300, structured_outputs=StructuredOutputsParams(json=SCHEMA))
              for t in (0, 1)]
    outputs = [llm.generate(["ROMEO:", "JULIET:"], p, use_tqdm=False) for p in params]
    for result in outputs:
        for prompt in result:
            assert matches_schema(json.loads(prompt.outputs[0].text)) and prompt.outputs[0].finish_reason == "stop"


def test_after_reasoning_the_grammar_starts_at_the_end_of_thinking(tok):
    grammars = Grammars(tok, len(tok))
    compiled = grammars.compile(StructuredOutputsParams(choice=["yes", "no"], after_reasoning=True))

    def accepts(text: str) -> bool:
        matcher = xgr.GrammarMatcher(compiled)
        return matcher.accept_string(text) and matcher.is_completed()

    assert accepts("Hmm, yes or no? no.</think>yes") and accepts("</think>no")
    assert not accepts("yes") and not accepts("a</think>b</think>yes") and not accepts("a</think>maybe")
