"""V4 compressors: the reference against transformers' CSA / HCA compressor modules, and the
state: one-shot, chunked and token-by-token (batched decode steps) compression agree exactly."""

from __future__ import annotations

import os

import pytest
import torch

from flashdsa.runtime.compressor import compress_decode_step, compress_sequence, new_state

modeling = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")
configuration = pytest.importorskip("transformers.models.deepseek_v4.configuration_deepseek_v4")

SEED = int.from_bytes(os.urandom(4), "little")  # fresh inputs every run; printed on failure
CSA_RATIO, HCA_RATIO = 4, 8


def tiny_config():
    return configuration.DeepseekV4Config(
        hidden_size=32, head_dim=16, qk_rope_head_dim=4, num_attention_heads=2, q_lora_rank=16, index_head_dim=8,
        index_n_heads=2, vocab_size=50, num_hidden_layers=2,
        compress_rates={"compressed_sparse_attention": CSA_RATIO, "heavily_compressed_attention": HCA_RATIO})


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("seq_len", [3, 8, 33])
def test_entries_match_transformers_compressor_after_its_norm_and_rope(overlap, seq_len):
    torch.manual_seed(SEED + seq_len)
    config = tiny_config()
    cls = modeling.DeepseekV4CSACompressor if overlap else modeling.DeepseekV4HCACompressor
    module = cls(config).double()
    for p in module.parameters():
        torch.nn.init.normal_(p, std=0.5)
    hidden = torch.randn(1, seq_len, 32, dtype=torch.float64)
    ratio = CSA_RATIO if overlap else HCA_RATIO
    with torch.no_grad():
        want = module(hidden, torch.randn(1, seq_len, 16, dtype=torch.float64), torch.arange(seq_len)[None], None, 0)[0]
        entries, _, _ = compress_sequence(module.kv_proj(hidden[0]).float(), module.gate_proj(hidden[0]).float(),
                                          module.position_bias.float(), overlap)
        entries = module.kv_norm(entries.double())[None]
        positions = (torch.arange(entries.shape[1]) * ratio)[None]
        cos, sin = module.rotary_emb(entries, position_ids=positions, layer_type="compress")
        got = modeling.apply_rotary_pos_emb(entries.unsqueeze(1), cos, sin)
    assert got.shape == want.shape == (1, 1, seq_len // ratio, 16)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"seed {SEED}")


def random_tokens(length: int, channels: int, ratio: int, g: torch.Generator):
    kv = torch.randn(length, channels, generator=g)
    gate = torch.randn(length, channels, generator=g) * 2
    return kv, gate, torch.randn(ratio, channels, generator=g)


@pytest.mark.parametrize("overlap, ratio", [(True, 4), (False, 4), (False, 128)])
def test_chunked_and_token_by_token_compression_equal_one_shot(overlap, ratio):
    g = torch.Generator().manual_seed(SEED + ratio)
    channels, length = 12, 3 * ratio + ratio // 2 + 1
    kv, gate, bias = random_tokens(length, channels, ratio, g)
    whole, _, _ = compress_sequence(kv, gate, bias, overlap)
    assert whole.shape == (length // ratio, channels // 2 if overlap else channels)

    cuts = sorted({0, length, *torch.randint(1, length, (3,), generator=g).tolist()})
    state_kv, state_score = (t[0] for t in new_state(1, ratio, channels, overlap, "cpu"))
    parts = [compress_sequence(kv[a:b], gate[a:b], bias, overlap, start_pos=a, state_kv=state_kv,
                               state_score=state_score)[0] for a, b in zip(cuts, cuts[1:])]
    torch.testing.assert_close(torch.cat(parts), whole, rtol=0, atol=0, msg=f"seed {SEED}, cuts {cuts}")

    # a batch of 2: sequence 0 prefilled up to `split`, then both step token by token (different positions)
    split = length // 2
    states = new_state(2, ratio, channels, overlap, "cpu")
    compress_sequence(kv[:split], gate[:split], bias, overlap, state_kv=states[0][0], state_score=states[1][0])
    stepped = [[], []]
    for t in range(length - split):
        positions = torch.tensor([split + t, t])
        entries, closed = compress_decode_step(kv[positions], gate[positions], positions, bias, overlap, *states)
        for b in (0, 1):
            if closed[b]:
                stepped[b].append(entries[b])
    head = whole[: split // ratio]
    torch.testing.assert_close(torch.cat([head, *[e[None] for e in stepped[0]]]), whole, rtol=0, atol=1e-6)
    want = compress_sequence(kv[: length - split], gate[: length - split], bias, overlap)[0]
    torch.testing.assert_close(torch.stack(stepped[1]) if stepped[1] else want, want, rtol=0, atol=1e-6)


def test_bad_inputs_raise_value_errors_naming_the_argument():
    kv, gate, bias = torch.randn(5, 6), torch.randn(5, 6), torch.randn(4, 6)
    with pytest.raises(ValueError, match="gate must be"):
        compress_sequence(kv, gate[:, :4], bias, True)
    with pytest.raises(ValueError, match="position_bias must be"):
        compress_sequence(kv, gate, bias[:, :3], True)
    with pytest.raises(ValueError, match="2 D with overlap"):
        compress_sequence(kv[:, :5], gate[:, :5], bias[:, :5], True)
    with pytest.raises(ValueError, match="needs the state"):
        compress_sequence(kv, gate, bias, True, start_pos=3)
    with pytest.raises(ValueError, match="state_kv must be"):
        wrong = torch.zeros(2, 4, 6)  # CSA with ratio 4 needs 8 rows
        compress_decode_step(kv[:2], gate[:2], torch.tensor([0, 1]), bias, True, wrong, wrong.clone())
    with pytest.raises(ValueError, match="positions must be"):
        states = new_state(2, 4, 6, False, "cpu")
        compress_decode_step(kv[:2], gate[:2], torch.tensor([0, 1], dtype=torch.int32), bias, False, *states)
    with pytest.raises(ValueError, match="out_dtype must be one of bf16/fp16/fp32"):
        compress_decode_step(kv[:2], gate[:2], torch.tensor([0, 1]), bias, False, *states, out_dtype=torch.int32)


def test_decode_step_pool_arguments_raise_value_errors_naming_the_argument():
    kv, gate, bias, positions = torch.randn(2, 6), torch.randn(2, 6), torch.randn(4, 6), torch.tensor([0, 5])
    pool = new_state(5, 4, 6, False, "cpu")
    with pytest.raises(ValueError, match="state_slots must be"):
        compress_decode_step(kv, gate, positions, bias, False, *pool, state_slots=torch.tensor([0, 1], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"state_slots must lie in \[0, 5\)"):
        compress_decode_step(kv, gate, positions, bias, False, *pool, state_slots=torch.tensor([4, 5]))
    with pytest.raises(ValueError, match="fresh must be"):
        compress_decode_step(kv, gate, positions, bias, False, *pool, state_slots=torch.tensor([4, 0]),
                             fresh=torch.tensor([1, 0]))
    with pytest.raises(ValueError, match="state_kv must be"):  # without state_slots the states are [B, W, C]
        compress_decode_step(kv, gate, positions, bias, False, *pool)


def test_decode_step_on_a_pool_updates_only_the_named_rows_and_empties_fresh_ones():
    g = torch.Generator().manual_seed(SEED)
    kv, gate, bias = random_tokens(2, 6, 4, g)
    pool = [torch.randn(5, 8, 6, generator=g) for _ in range(2)]
    before = [t.clone() for t in pool]
    slots, fresh, positions = torch.tensor([3, 1]), torch.tensor([True, False]), torch.tensor([0, 6])
    compress_decode_step(kv, gate, positions, bias, True, *pool, state_slots=slots, fresh=fresh)
    untouched = torch.tensor([0, 2, 4])
    assert torch.equal(pool[0][untouched], before[0][untouched]) and torch.equal(pool[1][untouched], before[1][untouched])
    alone = new_state(1, 4, 6, True, "cpu")  # the fresh sequence: as if it started from new_state
    compress_decode_step(kv[:1], gate[:1], positions[:1], bias, True, *alone)
    assert torch.equal(pool[0][3], alone[0][0]) and torch.equal(pool[1][3], alone[1][0])
    own = [t[1:2].clone() for t in before]  # the other: as if its own row were the whole state
    compress_decode_step(kv[1:], gate[1:], positions[1:], bias, True, *own)
    assert torch.equal(pool[0][1], own[0][0]) and torch.equal(pool[1][1], own[1][0])
