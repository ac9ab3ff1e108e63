"""Tiny checkpoints shared by the model tests (written once per session)."""

import pytest
import torch

from flashdsa.models.tiny import make_tiny_checkpoint


@pytest.fixture(scope="session")
def shrunk(tmp_path_factory):
    """Shrunk widths, one safetensors file: the fast reference-mode checkpoint."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("shrunk"), shrink=True, seed=1)


@pytest.fixture(scope="session")
def full_width(tmp_path_factory):
    """V3.2 attention widths (d_qk 576, index_head_dim 128): production mode can run it."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("full"), seed=2)


@pytest.fixture(scope="session")
def hf_shrunk(shrunk):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(shrunk, dtype=torch.float32, attn_implementation="eager").eval()


@pytest.fixture
def random_ids():
    """``random_ids(n, seed)``: n ordinary (non-special) token ids of the tiny tokenizer's vocab."""
    return lambda n, seed=0: torch.randint(4, 500, (n,), generator=torch.Generator().manual_seed(seed))
