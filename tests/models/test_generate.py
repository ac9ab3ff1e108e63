"""generate: greedy output equals transformers' greedy generate; the sampler; the command."""

import re

import pytest
import torch

from flashdsa.cli import main
from flashdsa.generate import encode_prompt, generate_ids, sample
from flashdsa.models.loader import load_model


def test_greedy_generation_equals_transformers(shrunk, hf_shrunk, random_ids):
    prompt = random_ids(80, seed=5)
    want = hf_shrunk.generate(prompt[None], max_new_tokens=12, do_sample=False, eos_token_id=None)[0, 80:].tolist()
    model = load_model(shrunk, mode="reference")
    got, _, _ = generate_ids(model, prompt.tolist(), 12, lambda row: int(row.argmax()))
    assert got == want


def test_generation_stops_after_a_stop_token(shrunk, random_ids):
    model = load_model(shrunk, mode="reference")
    prompt = random_ids(10).tolist()
    first, _, _ = generate_ids(model, prompt, 3, lambda row: int(row.argmax()))
    stopped, _, _ = generate_ids(model, prompt, 3, lambda row: int(row.argmax()), stop={first[0]})
    assert stopped == first[:1]


def _logits():
    return torch.tensor([1.0, 3.0, 2.0, 0.5, 2.9])


def test_sampler_temperature_zero_is_argmax():
    assert sample(_logits(), 0.0, 1.0, 0, None) == 1


def test_sampler_top_k_and_top_p_restrict_the_choice():
    gen = torch.Generator().manual_seed(0)
    assert {sample(_logits(), 5.0, 1.0, 2, gen) for _ in range(200)} == {1, 4}
    assert {sample(_logits(), 1.0, 0.3, 0, gen) for _ in range(200)} == {1}  # the best token alone has 30%+
    assert {sample(_logits(), 1.0, 0.6, 0, gen) for _ in range(200)} == {1, 4}
    assert len({sample(_logits(), 5.0, 1.0, 0, gen) for _ in range(300)}) == 5


def test_sampler_is_reproducible_with_a_seed():
    draws = [[sample(_logits(), 2.0, 0.9, 4, torch.Generator().manual_seed(7)) for _ in range(5)] for _ in range(2)]
    assert draws[0] == draws[1]


def test_chat_prompt_uses_the_template(shrunk):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(shrunk)
    ids = encode_prompt(tokenizer, "hi", chat=True)
    assert ids[:2] == [0, 2] and ids[-1] == 3  # BOS, <｜User｜> ... <｜Assistant｜>
    assert encode_prompt(tokenizer, "hi", chat=False)[0] == 0


def test_generate_command_streams_text_and_ends_with_timings(shrunk, capsys):
    argv = ["generate", "--model", str(shrunk), "--prompt", "The sea is", "--max-tokens", "6",
            "--mode", "reference", "--device", "cpu", "--chat"]
    assert main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    assert re.fullmatch(r"\[prompt \d+ tokens, [\d.]+ tok/s \| generated 6 tokens, [\d.]+ tok/s\]", out[-1]), out[-1]


def test_generate_command_rejects_bad_arguments(shrunk):
    with pytest.raises(SystemExit):
        main(["generate", "--model", str(shrunk), "--prompt", "x", "--max-tokens", "0", "--device", "cpu"])
