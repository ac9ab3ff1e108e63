"""flashdsa check: passes in reference mode (the shipped default model too), reports exact ties as
ties, fails beyond thresholds."""

import json

import pytest
import torch

from flashdsa.check.layerwise import Run, _topk_agreement, compare
from flashdsa.cli import main
from flashdsa.defaults import DEFAULT_MODEL
from flashdsa.models.config import DeepseekV32Config
from flashdsa.models.deepseek_v4_tiny import make_tiny_v4_checkpoint
from flashdsa.models.tiny import make_tiny_checkpoint


@pytest.fixture(scope="module")
def v4_tiny(tmp_path_factory):
    return make_tiny_v4_checkpoint(tmp_path_factory.mktemp("v4check"), seed=2)


def test_check_passes_in_reference_mode(shrunk, capsys):
    assert main(["check", "--model", str(shrunk), "--tokens", "100"]) == 0
    out = capsys.readouterr().out
    assert "PASS (reference" in out and "greedy agreement 1.0000 over 100/100 tokens" in out
    assert len([line for line in out.splitlines() if line.strip()[:1].isdigit()]) == 2  # one row per layer


def test_check_passes_on_an_fp8_checkpoint(tmp_path, capsys):
    path = make_tiny_checkpoint(tmp_path, shrink=True, fp8=True, shards=2)
    assert main(["check", "--model", str(path), "--tokens", "80"]) == 0
    assert "PASS" in capsys.readouterr().out


def test_the_shipped_default_model_passes_check(capsys):
    assert main(["check", "--model", str(DEFAULT_MODEL), "--tokens", "48"]) == 0
    assert "PASS (reference" in capsys.readouterr().out


@pytest.mark.parametrize("mode", ["reference", "production"])
def test_check_passes_on_a_deepseek_v4_checkpoint(v4_tiny, mode, capsys):
    """Every layer reported (sliding, CSA, HCA, CSA), recall only where an indexer chooses."""
    assert main(["check", "--model", str(v4_tiny), "--mode", mode, "--tokens", "260"]) == 0
    out = capsys.readouterr().out
    assert f"PASS ({mode}" in out
    rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit()]
    assert [row[3] for row in rows] != ["-"] * 4 and [row[3] for row in rows][::2] == ["-", "-"]


@pytest.mark.parametrize("fp4_experts", [False, True])
def test_check_passes_on_a_deepseek_v4_fp8_checkpoint_in_production(tmp_path, capsys, fp4_experts):
    """The release's formats (FP8 linears, and FP4 experts) kept in production mode pass check
    against transformers on the checkpoint dequantized."""
    path = make_tiny_v4_checkpoint(tmp_path, fp8=True, fp4_experts=fp4_experts, seed=2)
    assert main(["check", "--model", str(path), "--mode", "production", "--tokens", "260"]) == 0
    assert "PASS (production" in capsys.readouterr().out


def test_written_configs_give_transformers_one_kv_head_per_query_head(shrunk):
    """transformers views MLA as multi-head attention: without num_key_value_heads its eager
    attention breaks (the shipped default model's config lacked it)."""
    written = [json.loads((path / "config.json").read_text()) for path in (shrunk, DEFAULT_MODEL)]
    for raw in (*written, DeepseekV32Config(num_attention_heads=6).to_dict()):
        assert raw["num_key_value_heads"] == raw["num_attention_heads"]


def _run(hidden, topk, scores, logits):
    return Run(hidden=[hidden], topk={0: topk}, scores={0: scores}, logits=logits)


def test_swap_between_exactly_tied_scores_is_a_tie_not_a_miss():
    scores = torch.tensor([[5.0, float("-inf"), float("-inf")], [5.0, 2.0, float("-inf")], [5.0, 1.0, 1.0]])
    hf = torch.tensor([[0, -1], [0, 1], [0, 2]])
    ours = torch.tensor([[0, -1], [0, 1], [0, 1]])  # token 2: position 1 instead of the tied position 2
    recall, ties = _topk_agreement(hf, ours, scores)
    assert ties == [2] and recall == 1.0
    scores[2, 2] = 1.5  # no longer tied: a real miss
    assert _topk_agreement(hf, ours, scores) == (pytest.approx(4 / 5), [])


def test_compare_counts_only_tokens_before_the_first_tie_in_reference_mode():
    torch.manual_seed(0)
    hidden, logits = torch.randn(3, 8), torch.randn(3, 16)
    scores = torch.tensor([[5.0, float("-inf"), float("-inf")], [5.0, 2.0, float("-inf")], [5.0, 1.0, 1.0]])
    hf = _run(hidden, torch.tensor([[0, -1], [0, 1], [0, 2]]), scores, logits)
    bad_last = hidden.clone()
    bad_last[2] += 1.0  # token 2 attended differently because of the tie
    ours = _run(bad_last, torch.tensor([[0, -1], [0, 1], [0, 1]]), scores, logits.clone())
    report = compare(hf, ours, "reference")
    assert report.rows == 2 and report.layers[0].tie_swaps == 1 and report.failures("reference") == []
    production = compare(hf, ours, "production")
    assert production.rows == 3 and production.layers[0].rel_err > 0.1


def test_failures_name_each_threshold_crossed():
    torch.manual_seed(0)
    hidden, logits = torch.randn(4, 8), torch.randn(4, 16)
    topk = torch.tensor([[0], [1], [2], [3]])
    scores = torch.randn(4, 4)
    ours = _run(hidden + 1e-2 * torch.randn(4, 8), topk, scores, -logits)
    failures = compare(_run(hidden, topk, scores, logits), ours).failures("reference")
    assert any("layer 0: max rel err" in f for f in failures)
    assert any("logits cosine" in f for f in failures) and any("greedy agreement" in f for f in failures)
