"""Model arguments: Hugging Face repo ids through the local HF cache (offline), the default model,
and the Python API's errors naming their parameter."""

import shutil

import pytest
import torch
from huggingface_hub import constants

from flashdsa.cli import main
from flashdsa.errors import ArgumentError
from flashdsa.models.resolve import parse_device, resolve_model
from flashdsa.runtime.llm import LLM
from flashdsa.runtime.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.fixture
def hf_cache(tmp_path, monkeypatch):
    """An empty Hugging Face cache with the Hub unreachable (offline mode)."""
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return tmp_path / "hub"


def cache_repo(hf_cache, repo_id: str, checkpoint) -> None:
    """Lay ``checkpoint`` out as the cached snapshot of ``repo_id`` (huggingface_hub's layout)."""
    repo = hf_cache / f"models--{repo_id.replace('/', '--')}"
    shutil.copytree(checkpoint, repo / "snapshots" / "0123abcd")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")


def test_repo_id_in_the_cache_resolves_offline_for_the_cli_and_llm(hf_cache, shrunk, capsys):
    cache_repo(hf_cache, "tiny-org/tiny-dsa", shrunk)
    assert resolve_model("tiny-org/tiny-dsa") == hf_cache / "models--tiny-org--tiny-dsa" / "snapshots" / "0123abcd"
    argv = ["generate", "--model", "tiny-org/tiny-dsa", "--mode", "reference", "--device", "cpu", "--max-tokens", "3"]
    assert main(argv) == 0
    assert "generated 3 tokens" in capsys.readouterr().out
    llm = LLM("tiny-org/tiny-dsa", mode="reference", device="cpu")
    assert len(llm.generate("The sea", GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 4


def test_repo_id_not_in_the_cache_says_where_it_looked(hf_cache, user_error):
    line = user_error(["generate", "--model", "tiny-org/absent"])
    assert "argument --model: tiny-org/absent is not a local directory nor in the Hugging Face cache" in line
    assert str(hf_cache) in line and "hf download tiny-org/absent" in line


def test_llm_without_a_path_takes_the_default_model_and_chats():
    llm = LLM(device="cpu", num_blocks=8)
    assert llm.engine.vocab_size == 2048  # the embedded Shakespeare model
    messages = [{"role": "user", "content": "Speak."}]
    (reply,) = llm.chat(messages, GREEDY, use_tqdm=False)
    want_prompt = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert reply.prompt == want_prompt and "Speak." in reply.prompt
    assert reply.prompt_token_ids == llm.tokenizer(want_prompt, add_special_tokens=False).input_ids
    assert len(reply.outputs[0].token_ids) == 4
    two = llm.chat([messages, [{"role": "user", "content": "Again."}]], GREEDY, use_tqdm=False)
    assert len(two) == 2 and two[0].prompt == want_prompt and "Again." in two[1].prompt


def test_devices_default_to_cuda_when_present():
    assert parse_device(None).type == ("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("options, name", [
    (dict(device="foo"), "device"),
    (dict(mode="fastest"), "mode"),
    (dict(max_model_len=100000, device="cpu"), "max_model_len"),
])
def test_llm_errors_name_the_parameter(options, name):
    with pytest.raises(ValueError, match=f"^{name}|{name} "):
        LLM(**options)


def test_llm_errors_about_the_model_are_argument_errors(tmp_path):
    with pytest.raises(ArgumentError) as info:
        LLM(tmp_path / "nowhere")
    assert info.value.argument == "model" and str(info.value).startswith("model: ")
