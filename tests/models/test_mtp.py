"""The MTP layer: official checkpoint layout in and out, and the check against the paper's equations."""

import re

import pytest
import torch
from safetensors import safe_open

from flashdsa.check.layerwise import THRESHOLDS
from flashdsa.check.mtp import compare_mtp, flashdsa_mtp, mtp_failures, reference_mtp
from flashdsa.models.loader import load_model
from flashdsa.models.tiny import make_tiny_checkpoint
from flashdsa.train.checkpoint import save_model


@pytest.fixture(scope="module")
def shrunk_mtp(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("shrunk_mtp"), shrink=True, seed=5, mtp=True)


def test_mtp_layer_loads_from_and_saves_to_the_official_layout(shrunk_mtp, tmp_path):
    model = load_model(shrunk_mtp, mode="reference", mtp=True)
    n = model.config.num_hidden_layers
    assert model.has_mtp and len(model.allocate_caches(1).mla) == n + 1
    save_model(model, tmp_path, shrunk_mtp)
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        names = set(f.keys())
        assert torch.equal(f.get_tensor(f"model.layers.{n}.shared_head.head.weight"), f.get_tensor("lm_head.weight"))
    for part in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight", "embed_tokens.weight",
                 "self_attn.indexer.wk.weight", "mlp.gate.weight"):
        assert f"model.layers.{n}.{part}" in names
    again = load_model(tmp_path, mode="reference", mtp=True)
    for (name, a), b in zip(model.state_dict().items(), again.state_dict().values()):
        assert torch.equal(a, b), name
    assert not load_model(shrunk_mtp, mode="reference").has_mtp  # skipped unless asked


def test_loading_mtp_from_a_checkpoint_without_one_names_the_fix(shrunk):
    with pytest.raises(ValueError, match="no multi-token-prediction layer.*--add-mtp-layer"):
        load_model(shrunk, mode="reference", mtp=True)


def test_mtp_matches_the_paper_reference_and_the_check_catches_swapped_norms(shrunk_mtp):
    ids = torch.randint(4, 500, (80,), generator=torch.Generator().manual_seed(0))
    model = load_model(shrunk_mtp, mode="reference", mtp=True)
    ref = reference_mtp(shrunk_mtp, ids, "cpu")
    result = compare_mtp(ref, flashdsa_mtp(model, ids))
    assert mtp_failures(result, THRESHOLDS["reference"]) == [], result
    mtp = model.model.mtp
    mtp.enorm.weight.data, mtp.hnorm.weight.data = mtp.hnorm.weight.data.clone(), mtp.enorm.weight.data.clone()
    assert mtp_failures(compare_mtp(ref, flashdsa_mtp(model, ids)), THRESHOLDS["reference"])


def test_generate_speculative_prints_the_acceptance_rate(shrunk_mtp, capsys):
    from flashdsa.cli import main

    argv = ["generate", "--model", str(shrunk_mtp), "--prompt", "The sea is", "--max-tokens", "12", "--mode",
            "reference", "--device", "cpu", "--temperature", "0", "--speculative-tokens", "1", "--verbose"]
    assert main(argv) == 0
    last = capsys.readouterr().out.splitlines()[-1]
    assert re.fullmatch(r"\[speculative decoding: \d+ draft tokens, \d+ accepted, acceptance rate [\d.]+%\]", last), last


def test_generate_speculative_without_an_mtp_layer_says_why(shrunk, capsys):
    from flashdsa.cli import main

    code = main(["generate", "--model", str(shrunk), "--device", "cpu", "--mode", "reference", "--speculative-tokens", "1"])
    assert code == 2 and "no multi-token-prediction layer" in capsys.readouterr().err
