"""Tiny DSA checkpoints and a synthetic corpus for the training tests (no shared data needed)."""

from __future__ import annotations

import random

import pytest
import torch

from flashdsa.models.deepseek_v32 import DeepseekV32ForCausalLM
from flashdsa.train.checkpoint import save_model
from flashdsa.train.init import initialize
from flashdsa.train.tokenizer import train_bpe_tokenizer
from train_configs import tiny_config

WORDS = "the a king queen lord speak hear my good sir thou art not what is love night day come go".split()


def synthetic_text(lines: int = 400, seed: int = 0) -> str:
    """Speaker-and-line text with some structure (so a tiny model can lower its loss quickly)."""
    rng = random.Random(seed)
    out = []
    for _ in range(lines):
        speaker = rng.choice(["KING", "QUEEN", "LORD"])
        words = [rng.choice(WORDS) for _ in range(rng.randint(3, 9))]
        out.append(f"{speaker}:\n{' '.join(words).capitalize()}.\n")
    return "\n".join(out)


@pytest.fixture(autouse=True)
def one_thread():
    """The tiny shapes here run fastest on one thread (two threads spin against each other when the
    machine is busy); restored after each test."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "corpus.txt"
    path.write_text(synthetic_text())
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, corpus):
    path = tmp_path_factory.mktemp("tiny_model")
    train_bpe_tokenizer([corpus.read_text()], 300, path)
    model = initialize(DeepseekV32ForCausalLM(tiny_config(300), mode="reference"), seed=0, std=0.1)
    save_model(model, path, dtype=None)
    return path


@pytest.fixture(scope="session")
def tiny_v4_dir(tmp_path_factory):
    """A tiny DeepSeek-V4 checkpoint (every layer type, hash and routed MoE, one MTP layer, narrow attention)."""
    from flashdsa.models.deepseek_v4_tiny import make_tiny_v4_checkpoint

    return make_tiny_v4_checkpoint(tmp_path_factory.mktemp("tiny_v4"), seed=3, small=True)  # narrow: fast
