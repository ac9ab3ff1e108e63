"""Loader: single/sharded/FP8 checkpoints give the same model; broken ones fail with named tensors."""

import json
import logging

import pytest
import torch
from safetensors.torch import load_file, save_file

from flashdsa.models.config import DeepseekV32Config
from flashdsa.models.loader import dequantize_blocks, load_model
from flashdsa.models.tiny import make_tiny_checkpoint
from flashdsa.runtime.gemm import quantize_weight


def _state(model):
    return {k: v.float() for k, v in model.state_dict().items()}


def test_sharded_checkpoint_loads_the_same_weights_as_a_single_file(shrunk, tmp_path):
    sharded = make_tiny_checkpoint(tmp_path, shrink=True, seed=1, shards=3)
    assert len(list(sharded.glob("model-*.safetensors"))) == 3
    one, three = _state(load_model(shrunk, mode="reference")), _state(load_model(sharded, mode="reference"))
    assert one.keys() == three.keys()
    for name in one:
        assert torch.equal(one[name], three[name]), name


def _dequantized_state(model) -> dict[str, torch.Tensor]:
    """Every weight of ``model`` as fp32 under its checkpoint name, e4m3 ones times their block scales."""
    state = model.state_dict()
    return {k: (dequantize_blocks(v, state[k + "_scale_inv"], (128, 128)) if v.dtype == torch.float8_e4m3fn
                else v.float()) for k, v in state.items() if not k.endswith("_scale_inv")}


def test_fp8_checkpoint_keeps_e4m3_weights_that_match_the_bf16_ones(shrunk, tmp_path):
    fp8 = make_tiny_checkpoint(tmp_path, shrink=True, seed=1, fp8=True, shards=2)
    model = load_model(fp8, mode="reference")
    state = model.state_dict()
    assert state["model.layers.0.self_attn.q_a_proj.weight"].dtype == torch.float8_e4m3fn
    assert state["model.layers.0.self_attn.q_a_proj.weight_scale_inv"].dtype == torch.float32
    reference = _state(load_model(shrunk, mode="reference"))
    name = "model.layers.0.self_attn.kv_b_proj.weight"  # FP8_EXEMPT: dequantized exactly at load
    q, scale = quantize_weight(reference[name])
    assert state[name].dtype == torch.float32 and torch.equal(state[name], dequantize_blocks(q, scale, (128, 128)))
    dequantized = _dequantized_state(model)
    assert dequantized.keys() == reference.keys()
    # e4m3 keeps 3 mantissa bits: every weight within 2^-4 of its block's largest scale step
    for key, value in dequantized.items():
        assert torch.allclose(value, reference[key], rtol=2**-4, atol=1e-3), key
    assert not torch.equal(dequantized[name], reference[name]), "weights were not quantized at all"


def test_fp8_checkpoint_resident_size_is_about_half_the_bf16_load(tmp_path):
    bf16 = load_model(make_tiny_checkpoint(tmp_path / "bf16", seed=3), mode="production")
    fp8 = load_model(make_tiny_checkpoint(tmp_path / "fp8", seed=3, fp8=True), mode="production")
    nbytes = lambda m: sum(t.numel() * t.element_size() for t in list(m.parameters()) + list(m.buffers()))  # noqa: E731
    linear = lambda m: sum(p.numel() for n, p in m.named_parameters()  # noqa: E731
                           if p.dim() >= 2 and "embed" not in n and "lm_head" not in n and "kv_b_proj" not in n)
    assert all(p.dtype == torch.float8_e4m3fn for n, p in fp8.named_parameters() if n.endswith("experts.down_proj"))
    # every FP8 weight saves one byte a value against bf16; the exempt layers stay as they are
    assert nbytes(bf16) - nbytes(fp8) >= 0.95 * linear(fp8)


def test_bf16_checkpoint_quantized_at_load_matches_the_fp8_checkpoint(tmp_path):
    bf16 = load_model(make_tiny_checkpoint(tmp_path / "bf16", seed=4), quantization="fp8")
    fp8 = load_model(make_tiny_checkpoint(tmp_path / "fp8", seed=4, fp8=True))
    a, b = _dequantized_state(bf16), _dequantized_state(fp8)
    for key in a:
        assert torch.allclose(a[key], b[key], rtol=2**-3, atol=1e-2), key


def test_dequantize_blocks_uses_one_scale_per_128x128_block():
    w = torch.ones(130, 260, dtype=torch.float8_e4m3fn)
    scale = torch.arange(1.0, 7.0).view(2, 3)
    out = dequantize_blocks(w, scale, (128, 128))
    assert out[0, 0] == 1 and out[127, 127] == 1 and out[0, 128] == 2 and out[129, 259] == 6
    with pytest.raises(ValueError, match="scale_inv"):
        dequantize_blocks(w, scale[:1], (128, 128))


def test_mtp_layer_is_skipped_with_one_log_line(shrunk, tmp_path, caplog):
    path = make_tiny_checkpoint(tmp_path, shrink=True, seed=1)
    tensors = load_file(path / "model.safetensors")
    n = DeepseekV32Config.from_json(path).num_hidden_layers
    tensors[f"model.layers.{n}.eh_proj.weight"] = torch.randn(64, 128)
    tensors[f"model.layers.{n}.shared_head.norm.weight"] = torch.randn(64)
    save_file(tensors, path / "model.safetensors")
    with caplog.at_level(logging.INFO, logger="flashdsa.models.loader"):
        load_model(path, mode="reference")
    assert [r.message for r in caplog.records if "multi-token" in r.message] == [
        "skipped 2 tensors of the multi-token-prediction layer(s) (not loaded)"
    ]


def _edit(path, change):
    tensors = load_file(path / "model.safetensors")
    change(tensors)
    save_file(tensors, path / "model.safetensors")


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda t: t.pop("model.layers.1.mlp.experts.2.up_proj.weight"), r"missing \(1\): model.layers.1.mlp.experts.2.up_proj"),
        (lambda t: t.update({"model.layers.0.bogus.weight": torch.zeros(2)}), r"unexpected \(1\): model.layers.0.bogus.weight"),
        (lambda t: t.update({"lm_head.weight": torch.zeros(3, 64)}), r"mis-shaped \(1\): lm_head.weight: expected \[\d+, 64\], got \[3, 64\]"),
    ],
    ids=["missing", "unexpected", "misshaped"],
)
def test_broken_checkpoint_names_the_offending_tensor(tmp_path, change, message):
    path = make_tiny_checkpoint(tmp_path, shrink=True, seed=1)
    _edit(path, change)
    with pytest.raises(ValueError, match=message):
        load_model(path, mode="reference")


def test_missing_files_are_named(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        load_model(tmp_path)
    path = make_tiny_checkpoint(tmp_path / "ckpt", shrink=True, shards=2)
    (path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ValueError, match="shards that do not exist.*model-00002-of-00002"):
        load_model(path, mode="reference")


def test_fp8_weight_without_scale_is_rejected(tmp_path):
    path = make_tiny_checkpoint(tmp_path, shrink=True, fp8=True)
    _edit(path, lambda t: t.pop("model.layers.0.self_attn.o_proj.weight_scale_inv"))
    with pytest.raises(ValueError, match="o_proj.weight has no model.layers.0.self_attn.o_proj.weight_scale_inv"):
        load_model(path, mode="reference")


def test_production_mode_keeps_router_bias_and_indexer_weights_in_fp32(full_width):
    model = load_model(full_width, mode="production")
    params = dict(model.state_dict())
    assert params["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    assert params["model.layers.0.self_attn.indexer.weights_proj.weight"].dtype == torch.float32
    assert params["model.layers.0.self_attn.kv_b_proj.weight"].dtype == torch.bfloat16


def test_production_mode_rejects_shrunk_widths(shrunk):
    with pytest.raises(ValueError, match="production mode needs"):
        load_model(shrunk, mode="production")


def test_config_reads_both_rope_forms(shrunk):
    raw = json.loads((shrunk / "config.json").read_text())
    old = DeepseekV32Config.from_dict(raw)
    rope = {"rope_theta": raw.pop("rope_theta"), "rope_type": "yarn", **raw.pop("rope_scaling")}
    new = DeepseekV32Config.from_dict({**raw, "rope_parameters": rope})
    assert new.rope_theta == old.rope_theta and new.softmax_scale == old.softmax_scale
    assert old.softmax_scale == pytest.approx(32**-0.5 * (0.1 * 1.0 * torch.tensor(4.0).log().item() + 1) ** 2)
    with pytest.raises(ValueError, match="model_type"):
        DeepseekV32Config.from_dict({**raw, "model_type": "llama"})


def test_yarn_frequencies_and_scale_match_transformers(full_width):
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from flashdsa.models.rope import Rotary

    hf = AutoConfig.from_pretrained(full_width)
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
    ours = Rotary(DeepseekV32Config.from_json(full_width))
    assert torch.equal(ours.inv_freq, inv_freq) and ours.attention_factor == attention_factor


def test_make_tiny_command_writes_a_checkpoint_transformers_and_flashdsa_load(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from flashdsa.cli import main

    assert main(["make-tiny", str(tmp_path), "--shrink", "--seed", "3", "--shards", "2"]) == 0
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    ours = load_model(tmp_path, mode="reference")
    name = "model.layers.1.mlp.experts.3.down_proj.weight"
    assert torch.equal(hf.model.layers[1].mlp.experts.down_proj[3], ours.state_dict()[name])
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    assert tokenizer.bos_token_id == 0 and tokenizer.eos_token_id == 1 and tokenizer.chat_template
    assert len(tokenizer) == ours.config.vocab_size
