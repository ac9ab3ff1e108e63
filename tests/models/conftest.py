"""Tiny checkpoints shared by the model tests (written once per session), and the GPU tests' host-sync counter."""

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


@pytest.fixture
def steps_without_syncs(monkeypatch):
    """``steps_without_syncs(engine, n)`` -> (each step's outputs, waits, graph replays): n engine
    steps under sync debug mode "error", where every stream sync or blocking copy raises; the one
    wait a step may make, for the step before's tokens, is an event synchronize (which that mode
    lets through), counted in ``waits``; ``replays`` names each replay of the decode graphs in order."""

    def run(engine, n: int):
        waits, replays = [], []
        synchronize = torch.cuda.Event.synchronize
        monkeypatch.setattr(torch.cuda.Event, "synchronize", lambda event: waits.append(1) or synchronize(event))
        graphs = engine.runner.graphs
        for name in ("replay", "replay_draft", "replay_verdict"):
            replay = getattr(graphs, name)
            monkeypatch.setattr(graphs, name, lambda *a, replay=replay, name=name: replays.append(name) or replay(*a))
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            outputs = [engine.step() for _ in range(n)]
        finally:
            torch.cuda.set_sync_debug_mode("default")
        return outputs, len(waits), replays

    return run
