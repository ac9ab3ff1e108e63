"""Every user error of the command line: one line naming the argument and the fix, exit status 2,
no traceback (``--debug`` adds it)."""

import json
import shutil
import socket

import pytest
import torch

from flashdsa.cli import main
from flashdsa.defaults import DEFAULT_MODEL


@pytest.fixture
def damaged(tmp_path, shrunk):
    """``damaged(kind)``: a copy of the shrunk checkpoint broken in one way."""

    def make(kind: str):
        path = tmp_path / kind
        shutil.copytree(shrunk, path)
        weights = path / "model.safetensors"
        if kind == "truncated weights":
            weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
        elif kind == "no weights":
            weights.unlink()
        elif kind == "truncated config":
            (path / "config.json").write_text((path / "config.json").read_text()[:100])
        elif kind == "llama":
            (path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
        elif kind == "no tokenizer":
            for name in ("tokenizer.json", "tokenizer_config.json"):
                (path / name).unlink()
        return path

    return make


def test_model_that_is_missing_empty_or_a_file_is_named(user_error, tmp_path):
    line = user_error(["generate", "--model", tmp_path / "nowhere"])
    assert "argument --model:" in line and "no such directory" in line
    (tmp_path / "empty").mkdir()
    line = user_error(["generate", "--model", tmp_path / "empty"])
    assert "argument --model:" in line and "is empty" in line
    (tmp_path / "file.bin").write_bytes(b"x")
    line = user_error(["serve", "--model", tmp_path / "file.bin"])
    assert "argument --model:" in line and "is a file; pass the checkpoint directory" in line


@pytest.mark.parametrize("kind, says", [
    ("truncated weights", "damaged or truncated weight file"),
    ("no weights", "no model.safetensors"),
    ("truncated config", "not valid JSON"),
    ("llama", "'llama' model: flashdsa runs DeepSeek-V3.2"),
    ("no tokenizer", "has no tokenizer"),
])
def test_damaged_or_foreign_checkpoints_are_named(user_error, damaged, kind, says):
    line = user_error(["generate", "--model", damaged(kind), "--device", "cpu", "--mode", "reference"])
    assert line.startswith("flashdsa generate: error: argument --model:") and says in line, line


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_cuda_is_refused(user_error):
    line = user_error(["generate", "--device", "cuda"])
    assert "argument --device:" in line and "CUDA is not available" in line and "use cpu" in line


@pytest.mark.parametrize("argv, flag, says", [
    (["generate", "--device", "foo"], "--device", "expected cpu, cuda or cuda:N"),
    (["--log-level", "bogus", "generate"], "--log-level", "invalid choice"),
    (["generate", "--log-level", "bogus"], "--log-level", "invalid choice"),
    (["serve", "--max-num-seqs", "0"], "--max-num-seqs", "must be an integer >= 1"),
    (["serve", "--num-blocks", "0"], "--num-blocks", "must be an integer >= 1"),
    (["serve", "--port", "99999"], "--port", "must be an integer in [0, 65535]"),
    (["serve", "--cache-fraction", "1.5"], "--cache-fraction", "must be a number in (0, 1]"),
    (["serve", "--max-model-len", "100000"], "--max-model-len", "exceeds the model's 1024 positions"),
    (["generate", "--max-tokens", "0"], "--max-tokens", "must be an integer >= 1"),
    (["generate", "--top-p", "0"], "--top-p", "must be a number in (0, 1]"),
    (["generate", "--temperature", "nan"], "--temperature", "must be a number >= 0"),
    (["generate", "--max-tokens", "5000", "--device", "cpu"], "--max-tokens", "maximum context length is 1024"),
    (["generate", "--prompt", "", "--device", "cpu"], "--prompt", "has 0 tokens"),
    (["check", "--model", DEFAULT_MODEL, "--tokens", "100000"], "--tokens", "at most the model's 1024 positions"),
    (["check"], "--model", "required"),
    (["generate", "--tensor-parallel-size", "0"], "--tensor-parallel-size", "must be an integer >= 1"),
])
def test_bad_values_name_their_flag(user_error, argv, flag, says):
    line = user_error(argv)
    assert f"argument {flag}" in line or f"arguments are required: {flag}" in line, line
    assert says in line, line


def test_production_mode_on_a_shrunk_checkpoint_names_mode(user_error, shrunk):
    line = user_error(["generate", "--model", shrunk, "--mode", "production", "--device", "cpu"])
    assert "argument --mode:" in line and "reference" in line


def test_port_in_use_is_refused_before_the_model_loads(user_error):
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        line = user_error(["serve", "--port", port, "--device", "cpu"])
    assert "argument --port:" in line and f"cannot listen on 127.0.0.1:{port}" in line and "pick another port" in line


def test_make_tiny_refuses_a_file_and_a_full_directory(user_error, tmp_path, shrunk):
    (tmp_path / "taken").write_text("mine")
    assert "argument DIR:" in user_error(["make-tiny", tmp_path / "taken"])
    assert (tmp_path / "taken").read_text() == "mine"
    line = user_error(["make-tiny", shrunk, "--shrink"])
    assert "is not empty; choose a new directory or pass --overwrite" in line


def test_debug_adds_the_traceback(capsys, tmp_path):
    assert main(["--debug", "generate", "--model", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and err.strip().splitlines()[-1].startswith("flashdsa generate: error: argument --model")
    assert main(["generate", "--model", str(tmp_path / "nowhere"), "--debug"]) == 2  # after the subcommand too
    assert "Traceback" in capsys.readouterr().err


@pytest.fixture
def finetune_argv(shrunk, tmp_path):
    data = tmp_path / "data.txt"
    data.write_text("to be or not to be " * 400)
    return ["finetune", "--model", shrunk, "--data", data, "--stage", "sparse", "--steps", "2", "--seq-len", "32",
            "--batch-tokens", "64", "--output", tmp_path / "out", "--device", "cpu"]


def _with(argv: list, flag: str, value) -> list:
    """``argv`` with ``flag``'s value replaced (or the flag added)."""
    if flag in argv:
        return [*argv[: argv.index(flag) + 1], value, *argv[argv.index(flag) + 2 :]]
    return [*argv, flag, value]


@pytest.mark.parametrize("content, says", [
    (None, "no such file"),
    ("", "holds no documents"),
    ('{"text": "fine"}\n{"text": \n', ":2: not valid JSON"),
    ('["a list"]\n', ":1: each line needs a string 'text' or a list 'messages'"),
    ('{"text": "short"}\n', "too few for seq_len 32"),
])
def test_finetune_data_errors_name_the_file(user_error, finetune_argv, tmp_path, content, says):
    data = tmp_path / "given.jsonl"
    if content is not None:
        data.write_text(content)
    line = user_error(_with(finetune_argv, "--data", data))
    assert "argument --data:" in line and says in line, line


def test_finetune_refuses_to_start_over_an_earlier_run(user_error, finetune_argv, tmp_path):
    (tmp_path / "out" / "checkpoints" / "step-000001").mkdir(parents=True)
    line = user_error(finetune_argv)
    assert "argument --output:" in line and "pass --resume to continue it" in line
    assert (tmp_path / "out" / "checkpoints" / "step-000001").is_dir()


@pytest.mark.parametrize("flag, value, says", [
    ("--steps", 0, "must be an integer >= 1"),
    ("--lr", -1, "must be a number > 0"),
    ("--seq-len", 5000, "at most the model's 4096 positions"),
    ("--batch-tokens", 16, "at least --seq-len (32)"),
    ("--eval-fraction", 0, "must be a number in (0, 0.5]"),
    ("--resume", None, "no checkpoint that loads"),
])
def test_finetune_settings_errors_name_the_flag(user_error, finetune_argv, flag, value, says):
    argv = [*finetune_argv, flag] if value is None else _with(finetune_argv, flag, value)
    line = user_error(argv)
    assert f"argument {flag}:" in line and says in line, line


def test_serve_generation_config_that_is_not_a_directory_is_named(user_error, tmp_path):
    line = user_error(["serve", "--generation-config", tmp_path / "nowhere", "--device", "cpu"])
    assert "argument --generation-config:" in line and "no such directory" in line
