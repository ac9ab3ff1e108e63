"""Serve tests: the helper modules next to them on sys.path, and the tiny checkpoints' tokenizer."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # the helpers next to the tests (fake_model, server_thread)


@pytest.fixture(scope="session")
def tok(tmp_path_factory):
    """The tiny checkpoints' byte-level BPE tokenizer (512 tokens, DeepSeek specials and chat template)."""
    from transformers import AutoTokenizer

    from flashdsa.models.tiny_tokenizer import save_tokenizer

    path = tmp_path_factory.mktemp("tokenizer")
    save_tokenizer(path)
    return AutoTokenizer.from_pretrained(str(path))


@pytest.fixture(scope="session")
def tiny_path(tmp_path_factory):
    """A tiny checkpoint with every width shrunk (reference mode only: fast on CPU)."""
    from flashdsa.models.tiny import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), shrink=True)


@pytest.fixture(scope="session")
def tiny(tiny_path):
    """(model, tokenizer) of tiny_path."""
    from transformers import AutoTokenizer

    from flashdsa.models.loader import load_model

    return load_model(tiny_path, mode="reference"), AutoTokenizer.from_pretrained(str(tiny_path))
