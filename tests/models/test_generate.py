"""generate: one request through the engine; greedy output equals transformers' greedy generate,
stop conditions, seeded sampling, the chat template, and the command's streamed output."""

import re

import pytest
import torch
from transformers import AutoTokenizer

from flashdsa.cli import main
from flashdsa.generate import encode_prompt, single_request_engine, stream_request
from flashdsa.models.loader import load_model
from flashdsa.runtime.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def tokenizer(shrunk):
    return AutoTokenizer.from_pretrained(shrunk)


@pytest.fixture(scope="module")
def model(shrunk):
    return load_model(shrunk, mode="reference")


def generate(model, tokenizer, prompt: list[int], **params) -> tuple[list[int], list[str]]:
    """Output ids and the text pieces streamed, for one request through a fresh engine."""
    params = SamplingParams(**{"temperature": 0.0, **params})
    engine = single_request_engine(model, tokenizer, len(prompt) + params.max_tokens)
    pieces: list[str] = []
    ids, prefill_s, decode_s = stream_request(engine, prompt, params, pieces.append)
    assert prefill_s > 0 and decode_s >= 0
    return ids, pieces


def test_greedy_generation_equals_transformers(model, tokenizer, hf_shrunk, random_ids):
    prompt = random_ids(80, seed=5)
    want = hf_shrunk.generate(prompt[None], max_new_tokens=12, do_sample=False, eos_token_id=None)[0, 80:].tolist()
    got, _ = generate(model, tokenizer, prompt.tolist(), max_tokens=12, ignore_eos=True)
    assert got == want


def test_generation_stops_after_a_stop_token(model, tokenizer, random_ids):
    prompt = random_ids(10).tolist()
    first, _ = generate(model, tokenizer, prompt, max_tokens=3, ignore_eos=True)
    assert len(first) == 3
    stopped, _ = generate(model, tokenizer, prompt, max_tokens=3, ignore_eos=True, stop_token_ids=[first[1]])
    assert stopped == first[:2]


def test_generation_stops_after_eos(shrunk, model, tokenizer, random_ids):
    prompt = random_ids(10).tolist()
    first, _ = generate(model, tokenizer, prompt, max_tokens=3, ignore_eos=True)
    eos_tokenizer = AutoTokenizer.from_pretrained(shrunk)
    eos_tokenizer.eos_token = eos_tokenizer.convert_ids_to_tokens(first[0])
    assert eos_tokenizer.eos_token_id == first[0]
    stopped, _ = generate(model, eos_tokenizer, prompt, max_tokens=3)
    assert stopped == first[:1]


def test_seeded_sampling_is_reproducible(model, tokenizer, random_ids):
    prompt = random_ids(10).tolist()
    params = dict(temperature=1.5, top_p=0.95, top_k=100, max_tokens=8, ignore_eos=True)
    runs = [generate(model, tokenizer, prompt, seed=seed, **params)[0] for seed in (7, 7, 8)]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


def test_streamed_pieces_add_up_to_the_decoded_output(model, tokenizer, random_ids):
    ids, pieces = generate(model, tokenizer, random_ids(10).tolist(), max_tokens=8, ignore_eos=True)
    assert len(pieces) > 1
    assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True)


def test_chat_prompt_uses_the_template(tokenizer):
    ids = encode_prompt(tokenizer, "hi", chat=True)
    assert ids[:2] == [0, 2] and ids[-2:] == [3, 5]  # BOS, <｜User｜> ... <｜Assistant｜></think>
    assert encode_prompt(tokenizer, "hi", chat=False)[0] == 0


def test_generate_command_streams_text_and_ends_with_timings(shrunk, capsys):
    """The same text with and without --async-scheduling (off by default on the CPU)."""
    argv = ["generate", "--model", str(shrunk), "--prompt", "The sea is", "--max-tokens", "6",
            "--mode", "reference", "--device", "cpu", "--chat"]
    texts = []
    for extra in ([], ["--async-scheduling"]):
        assert main(argv + extra) == 0
        out = capsys.readouterr().out.splitlines()
        assert re.fullmatch(r"\[prompt \d+ tokens, [\d.]+ tok/s \| generated 6 tokens, [\d.]+ tok/s\]", out[-1]), out[-1]
        texts.append(out[:-1])
    assert texts[0] == texts[1]


@pytest.mark.parametrize("bad", [["--max-tokens", "0"], ["--temperature", "-1"], ["--top-p", "0"]])
def test_generate_command_rejects_bad_arguments(shrunk, bad):
    with pytest.raises(SystemExit):
        main(["generate", "--model", str(shrunk), "--prompt", "x", "--device", "cpu", *bad])


def test_generate_command_defaults_to_the_embedded_model(capsys):
    assert main(["generate", "--max-tokens", "4", "--device", "cpu"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "".join(out[:-1]).strip(), out  # some text before the timings
    assert re.fullmatch(r"\[prompt \d+ tokens, [\d.]+ tok/s \| generated 4 tokens, [\d.]+ tok/s\]", out[-1]), out[-1]


def test_generate_command_quantizes_a_bf16_checkpoint_to_fp8_and_runs_eagerly(capsys):
    """--quantization fp8 turns the embedded bf16 model's linear layers into e4m3 (--enforce-eager:
    no CUDA graphs); the text still comes out, and an unknown scheme is one line, exit 2."""
    code = main(["generate", "--device", "cpu", "--max-tokens", "8", "--temperature", "0", "--quantization", "fp8",
                 "--enforce-eager"])
    assert code == 0 and re.search(r"generated 8 tokens", capsys.readouterr().out)
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--quantization", "int4"])
    assert exit_info.value.code == 2 and "--quantization" in capsys.readouterr().err
