"""DeepSeek-V4 reference model against transformers' DeepseekV4ForCausalLM, and its own decode path."""

import pytest
import torch

from flashdsa.models import deepseek_v4_compressor
from flashdsa.models.deepseek_v4_loader import load_v4_model
from flashdsa.models.deepseek_v4_tiny import make_tiny_v4_checkpoint


@pytest.fixture(scope="module")
def v4_checkpoint(tmp_path_factory):
    return make_tiny_v4_checkpoint(tmp_path_factory.mktemp("v4"), seed=3, shards=2, small=True)


@pytest.fixture(scope="module")
def v4(v4_checkpoint):
    return load_v4_model(v4_checkpoint, mtp=True)


@pytest.fixture(scope="module")
def hf_v4(v4_checkpoint):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(v4_checkpoint, dtype=torch.float32).eval()


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def topk_sets(picks: torch.Tensor) -> list[list[int]]:
    """``[S, k]`` indices (-1 invalid) -> each row's sorted valid entries."""
    return [sorted(i for i in row.tolist() if i >= 0) for row in picks]


def test_every_layer_and_the_csa_topk_sets_match_transformers(v4, hf_v4, random_ids, monkeypatch):
    ids = random_ids(300, seed=1)
    hf_picks, ours_picks = [], []
    hooks = [m.register_forward_hook(lambda _m, _args, out: hf_picks.append(out[0]))
             for m in hf_v4.modules() if type(m).__name__ == "DeepseekV4Indexer"]
    try:
        with torch.no_grad():
            ref = hf_v4(ids[None], output_hidden_states=True, use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
    select = deepseek_v4_compressor.select_topk
    monkeypatch.setattr(deepseek_v4_compressor, "select_topk", lambda *a: ours_picks.append(select(*a)) or ours_picks[-1])
    out = v4.forward_sequence(ids, output_hidden_states=True)
    # transformers' hidden_states: the embeddings, each layer's output but the last, the normed output
    assert len(ref.hidden_states) == len(out.hidden_states) + 1
    for layer, hidden in enumerate(out.hidden_states[:-1]):
        assert relative(hidden, ref.hidden_states[layer + 1][0]) < 1e-4, f"layer {layer}"
    assert relative(out.logits, ref.logits[0]) < 1e-4
    assert len(ours_picks) == len(hf_picks) == 2  # the two CSA layers
    for ours, theirs in zip(ours_picks, hf_picks):
        assert topk_sets(ours) == topk_sets(theirs)
        assert max(len(s) for s in topk_sets(ours)) == 8  # index_topk of the 75 entries: a real selection


def test_greedy_decode_matches_transformers_over_256_tokens(v4, hf_v4, random_ids):
    prompt = random_ids(20, seed=2)
    ours = v4.generate_greedy(prompt, 256)
    sequence = torch.cat([prompt, ours])
    with torch.no_grad():
        ref = hf_v4(sequence[None], use_cache=False).logits[0, len(prompt) - 1:-1].argmax(-1)
    assert ours.tolist() == ref.tolist()


@pytest.mark.parametrize("length", [1, 3, 4, 5, 127, 128, 129, 300])
def test_prefill_then_decode_equals_one_full_pass(v4, random_ids, length):
    ids = random_ids(length, seed=length)
    full = v4.forward_sequence(ids).logits
    cache = v4.new_cache()
    split = 2 * length // 3  # the decode steps still cross the window (128) and HCA (256) boundaries
    steps = [v4.forward_sequence(ids[:split], cache).logits] if split else []
    steps += [v4.forward_sequence(ids[i:i + 1], cache).logits for i in range(split, length)]
    assert cache.length == length
    torch.testing.assert_close(torch.cat(steps), full, rtol=1e-4, atol=1e-4)


def test_chunked_prefill_equals_one_full_pass(v4, random_ids):
    ids = random_ids(300, seed=4)
    cache = v4.new_cache()
    chunks = [v4.forward_sequence(ids[i:i + 37], cache).logits for i in range(0, 300, 37)]  # 37: not a window multiple
    torch.testing.assert_close(torch.cat(chunks), v4.forward_sequence(ids).logits, rtol=1e-4, atol=1e-4)


def test_mtp_layer_decodes_as_its_full_pass(v4, random_ids):
    ids = random_ids(140, seed=5)
    main = v4.forward_sequence(ids)
    full = v4.mtp_forward(ids[1:], main.streams[:-1], v4.new_cache())
    assert full.shape == (139, v4.config.vocab_size) and torch.isfinite(full).all()
    cache = v4.new_cache()
    steps = [v4.mtp_forward(ids[1:100], main.streams[:99], cache)]
    steps += [v4.mtp_forward(ids[i + 1:i + 2], main.streams[i:i + 1], cache) for i in range(99, 139)]
    torch.testing.assert_close(torch.cat(steps), full, rtol=1e-4, atol=1e-4)


def test_sparse_sink_attention_against_a_dense_softmax():
    from flashdsa.models.deepseek_v4_attention import sparse_sink_attention

    gen = torch.Generator().manual_seed(0)
    q, kv, sinks = torch.randn(5, 3, 8, generator=gen), torch.randn(7, 8, generator=gen), torch.randn(3, generator=gen)
    indices = torch.tensor([[0, 1, -1], [2, 2, 6], [-1, -1, -1], [6, 7, 3], [4, 5, 0]])  # 7 is out of range
    out = sparse_sink_attention(q, kv, indices, sinks, 0.5)
    for s in range(5):
        rows = [i for i in indices[s].tolist() if 0 <= i < 7]
        if not rows:
            assert (out[s] == 0).all()
            continue
        logits = torch.cat([0.5 * q[s] @ kv[rows].T, sinks[:, None]], dim=1)
        expected = logits.softmax(-1)[:, :-1] @ kv[rows]
        torch.testing.assert_close(out[s], expected)


@pytest.mark.parametrize("ids", [torch.tensor([]), torch.zeros(2, 3), torch.tensor([0, 512]), torch.tensor([-1])])
def test_bad_input_ids_raise_naming_them(v4, ids):
    with pytest.raises(ValueError, match="input_ids"):
        v4.forward_sequence(ids.long())
