"""Random official-layout checkpoints: FP8 where DeepSeek stores FP8, loadable and servable."""

import json

import torch
from safetensors import safe_open

from flashdsa.models.loader import load_model
from flashdsa.models.synthetic import v4_flash_config, v32_config, write_random_checkpoint, write_random_v4_checkpoint
from flashdsa.runtime.llm import LLM
from flashdsa.runtime.sampling_params import SamplingParams

SMALL = dict(hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_attention_heads=4,
             num_key_value_heads=4, q_lora_rank=128, n_routed_experts=16, n_group=4, topk_group=2, vocab_size=1000,
             index_n_heads=8, index_topk=64, max_position_embeddings=4096)


def test_v32_config_keeps_one_moe_layer_and_the_official_widths():
    raw = v32_config(4)
    assert raw["first_k_dense_replace"] == 3 and raw["num_hidden_layers"] == 4
    assert raw["hidden_size"] == 7168 and raw["n_routed_experts"] == 256 and raw["vocab_size"] == 129280
    assert v32_config(1)["first_k_dense_replace"] == 0


def test_random_checkpoint_is_official_fp8_layout_and_generates(tmp_path):
    path = write_random_checkpoint(tmp_path, v32_config(2, **SMALL))
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    expert = "model.layers.1.mlp.experts.7.up_proj.weight"
    assert expert + "_scale_inv" in index and "model.embed_tokens.weight_scale_inv" not in index
    with safe_open(path / index[expert], framework="pt") as f:
        assert f.get_tensor(expert).dtype == torch.float8_e4m3fn
    model = load_model(path)
    assert model.model.layers[1].mlp.experts.gate_up_proj.dtype == torch.float8_e4m3fn
    llm = LLM(path, max_num_seqs=2)
    out = llm.generate([[5, 6, 7], [8, 9]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
                       use_tqdm=False)
    assert [len(r.outputs[0].token_ids) for r in out] == [4, 4]


def test_random_v4_flash_checkpoint_covers_every_attention_type_and_generates(tmp_path):
    raw = v4_flash_config(4, hidden_size=128, moe_intermediate_size=128, n_routed_experts=8, num_attention_heads=8,
                          q_lora_rank=64, o_lora_rank=64, index_n_heads=4, vocab_size=300)
    assert raw["compress_ratios"] == [0, 4, 128, 4] and v4_flash_config()["hidden_size"] == 4096
    path = write_random_v4_checkpoint(tmp_path, raw)
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    assert "layers.1.attn.wq_b.scale" in index  # FP8 with UE8M0 block scales, as the release
    assert "layers.1.ffn.experts.0.w1.scale" in index  # FP4 experts, as the release
    llm = LLM(str(path), device="cpu", max_num_seqs=2)
    out = llm.generate([[5, 6, 7], [8] * 140], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert [len(r.outputs[0].token_ids) for r in out] == [3, 3]
