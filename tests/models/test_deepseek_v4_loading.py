"""DeepSeek-V4 config parsing, checkpoint layouts and formats, tiny checkpoints."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from flashdsa.models.deepseek_v4_config import DeepseekV4Config, model_type
from flashdsa.models.deepseek_v4_loader import load_v4_model
from flashdsa.models.deepseek_v4_tiny import TINY, make_tiny_v4_checkpoint
from flashdsa.models.rope import Rotary
from flashdsa.runtime.fp4 import quantize_fp4


@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory):
    return make_tiny_v4_checkpoint(tmp_path_factory.mktemp("v4bf16"), seed=7, small=True)


@pytest.mark.parametrize("field, value", [
    ("compress_ratios", [0, 4, 64, 4]), ("compress_ratios", [0, 4]), ("num_hash_layers", 5),
    ("num_key_value_heads", 2), ("o_groups", 3), ("qk_rope_head_dim", 15), ("scoring_func", "relu"),
    ("num_experts_per_tok", 9), ("hidden_size", 0), ("index_topk", -1), ("swiglu_limit", 0.0),
    ("layer_types", ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"]),
    ("mlp_layer_types", ["moe", "hash_moe", "moe", "moe"]), ("model_type", "deepseek_v32"),
])
def test_inconsistent_config_fields_raise_naming_the_field(field, value):
    raw = {**TINY, "vocab_size": 512, field: value}
    if field == "layer_types":
        raw.pop("compress_ratios")
    with pytest.raises(ValueError, match=field.removeprefix("num_")):
        DeepseekV4Config.from_dict(raw)


def test_transformers_spelling_reads_as_the_official_one():
    official = DeepseekV4Config.from_dict({**TINY, "vocab_size": 512})
    hf = DeepseekV4Config.from_dict({
        **{k: v for k, v in TINY.items() if k not in ("compress_ratios", "num_hash_layers", "qk_rope_head_dim",
                                                        "rope_scaling", "rope_theta", "compress_rope_theta")},
        "vocab_size": 512, "partial_rotary_factor": 0.25,
        "layer_types": ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                        "compressed_sparse_attention"],
        "mlp_layer_types": ["hash_moe", "hash_moe", "moe", "moe"],
        "rope_parameters": {"main": {"rope_type": "default", "rope_theta": 10000.0},
                            "compress": {**TINY["rope_scaling"], "rope_type": "yarn", "rope_theta": 160000.0}},
    })
    for name in ("compress_ratios", "hash_layers", "qk_rope_head_dim", "rope_theta", "compress_rope_theta"):
        assert getattr(hf, name) == getattr(official, name), name
    for compressed in (False, True):
        a, b = Rotary(hf.rope(compressed)), Rotary(official.rope(compressed))
        assert torch.equal(a.inv_freq, b.inv_freq) and a.attention_factor == b.attention_factor == 1.0
    assert hf.rope(False).rope_scaling is None and not torch.equal(Rotary(hf.rope(True)).inv_freq,
                                                                     Rotary(hf.rope(False)).inv_freq)


def test_model_type_tells_v4_from_v32(bf16_checkpoint, shrunk):
    assert model_type(bf16_checkpoint) == "deepseek_v4"
    assert model_type(shrunk) == "deepseek_v32"


def test_fp8_ue8m0_checkpoint_loads_close_to_its_bf16_twin(bf16_checkpoint, tmp_path, random_ids):
    fp8 = make_tiny_v4_checkpoint(tmp_path / "fp8", seed=7, fp8=True, small=True)
    stored = load_file(fp8 / "model.safetensors")
    assert stored["layers.0.attn.wq_a.weight"].dtype == torch.float8_e4m3fn
    assert stored["layers.0.attn.wq_a.scale"].dtype == torch.float8_e8m0fnu
    assert stored["layers.1.attn.compressor.wkv.weight"].dtype == torch.bfloat16
    ids = random_ids(64)
    a, b = load_v4_model(bf16_checkpoint).forward_sequence(ids).logits, load_v4_model(fp8).forward_sequence(ids).logits
    assert torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0) > 0.99


def test_transformers_layout_loads_the_same_model(bf16_checkpoint, tmp_path, random_ids):
    official = load_v4_model(bf16_checkpoint, mtp=True)
    (tmp_path / "config.json").write_text((bf16_checkpoint / "config.json").read_text())
    save_file({k: v.contiguous() for k, v in official.state_dict().items()}, tmp_path / "model.safetensors")
    ids = random_ids(40)
    torch.testing.assert_close(load_v4_model(tmp_path).forward_sequence(ids).logits, official.forward_sequence(ids).logits)


def _rewrite(checkpoint, tmp_path, edit):
    weights = load_file(checkpoint / "model.safetensors")
    edit(weights)
    save_file(weights, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((checkpoint / "config.json").read_text())
    return tmp_path


def _e2m1(code: torch.Tensor) -> torch.Tensor:
    """e2m1 nibbles by their bits (sign, 2 exponent bits with bias 1, 1 mantissa bit; exponent 0: subnormal)."""
    sign = 1 - 2 * ((code >> 3) & 1).float()
    exponent, mantissa = ((code >> 1) & 3).float(), (code & 1).float()
    magnitude = torch.where(exponent == 0, 0.5 * mantissa, (1 + 0.5 * mantissa) * torch.exp2(exponent - 1))
    return sign * magnitude


def test_fp4_experts_load_dequantized(bf16_checkpoint, tmp_path):
    """DeepSeek's FP4 experts: two e2m1 values a byte (low nibble first), a UE8M0 scale per 32 inputs."""
    stored = {}

    def to_fp4(w):
        for name in [n for n in w if ".ffn.experts." in n]:
            packed, scale = quantize_fp4(w[name])
            w[name], w[name.removesuffix(".weight") + ".scale"] = packed, scale
            byte = packed.view(torch.uint8).long()
            values = torch.stack([_e2m1(byte & 0xF), _e2m1(byte >> 4)], dim=-1).flatten(-2)
            stored[name] = values * scale.float().repeat_interleave(32, dim=-1)
    path = _rewrite(bf16_checkpoint, tmp_path, to_fp4)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "expert_dtype": "fp4"}))
    experts = load_v4_model(path).model.layers[0].mlp.experts
    gate, up = experts.gate_up_proj[3].chunk(2)
    torch.testing.assert_close(gate, stored["layers.0.ffn.experts.3.w1.weight"], rtol=0, atol=0)
    torch.testing.assert_close(up, stored["layers.0.ffn.experts.3.w3.weight"], rtol=0, atol=0)
    torch.testing.assert_close(experts.down_proj[3], stored["layers.0.ffn.experts.3.w2.weight"], rtol=0, atol=0)
    original = load_file(bf16_checkpoint / "model.safetensors")["layers.0.ffn.experts.3.w2.weight"].float()
    assert ((experts.down_proj[3] - original).norm() / original.norm()) < 0.2  # FP4 keeps the weights, coarsely


def test_fp4_experts_without_scales_are_named(bf16_checkpoint, tmp_path):
    def to_fp4(w):
        w["layers.0.ffn.experts.0.w1.weight"] = torch.zeros(32, 32, dtype=torch.int8)
    with pytest.raises(ValueError, match=r"FP4 tensor layers\.0\.ffn\.experts\.0\.w1\.weight has no scales"):
        load_v4_model(_rewrite(bf16_checkpoint, tmp_path, to_fp4))


def test_missing_unexpected_and_misshaped_tensors_are_named(bf16_checkpoint, tmp_path):
    def damage(w):
        del w["layers.2.attn.compressor.ape"]
        w["layers.0.attn.wq_a.weight"] = w["layers.0.attn.wq_a.weight"][:5]
        w["layers.0.attn.bogus"] = torch.zeros(1)
    with pytest.raises(ValueError) as error:
        load_v4_model(_rewrite(bf16_checkpoint, tmp_path, damage))
    for part in ("model.layers.2.self_attn.compressor.position_bias", "layers.0.attn.bogus",
                 "layers.0.attn.wq_a.weight: expected [32, 64], got [5, 64]"):
        assert part in str(error.value)


def test_make_tiny_cli_writes_a_v4_checkpoint(tmp_path):
    from flashdsa.cli import main

    assert main(["make-tiny", str(tmp_path / "v4"), "--arch", "deepseek_v4"]) == 0
    assert model_type(tmp_path / "v4") == "deepseek_v4"
    assert load_v4_model(tmp_path / "v4", mtp=True).mtp


def _resident_bytes(model: torch.nn.Module) -> int:
    return sum(t.nbytes for t in [*model.parameters(), *model.buffers()])


def _file_bytes(path) -> int:
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def _cosine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=-1)


def test_fp8_checkpoint_keeps_its_linears_e4m3_in_production(tmp_path, monkeypatch):
    """Every e4m3 tensor of the release-like checkpoint (o_lora_rank and moe_intermediate_size
    widened to 128: whole scale blocks for the grouped wo_a and the experts) stays e4m3 in the
    production model, which then holds about the file's bytes (the dequantized one 1.6x here, where
    bf16 embeddings and fp32 parts weigh much), and its
    logits track the dequantized load's within the FP8 GEMM's activation rounding."""
    from flashdsa.models.deepseek_v4_loader import model_name
    from flashdsa.models.linear import FP8GroupedLinear, FP8Linear

    monkeypatch.setitem(TINY, "moe_intermediate_size", 128)
    monkeypatch.setitem(TINY, "o_lora_rank", 128)
    seed = int(torch.randint(1000, (1,)))
    path = make_tiny_v4_checkpoint(tmp_path, fp8=True, seed=seed)
    kept = load_v4_model(path, mode="production", mtp=True)
    dequantized = load_v4_model(path, mode="production", mtp=True, keep_fp8=False)
    stored, dests = load_file(path / "model.safetensors"), kept.state_dict()
    fp8_names = [n for n, t in stored.items() if t.dtype == torch.float8_e4m3fn]
    assert len(fp8_names) > 40
    for name in fp8_names:
        own, expert, half = model_name(name)
        assert dests[own].dtype == torch.float8_e4m3fn, own
        if expert is None:
            module = kept.get_submodule(own.removesuffix(".weight"))
            assert isinstance(module, FP8Linear) and module.pow2_scales, own
            assert torch.equal(dests[own].view(torch.uint8), stored[name].view(torch.uint8)), own
    assert isinstance(kept.model.layers[0].self_attn.o_a_proj, FP8GroupedLinear)
    assert kept.lm_head.weight.dtype == torch.bfloat16  # bf16 in the checkpoint: as stored
    resident, file = _resident_bytes(kept), _file_bytes(path)
    assert resident < 1.05 * file and _resident_bytes(dequantized) > 1.5 * file, (resident, file)
    ids = torch.randint(0, 500, (40,), generator=torch.Generator().manual_seed(seed))
    cosine = _cosine(kept.forward_sequence(ids).logits, dequantized.forward_sequence(ids).logits)
    # e4m3 activations with power-of-two scales in every linear and expert: median cosine ~0.995,
    # each position above `check`'s production threshold 0.8 but at most one, where the rounding
    # flips a routed expert (seed 688: one of 40 at 0.71; seed 507: one at 0.62, one at 0.88, mean 0.983)
    low = int((cosine < 0.8).sum())
    assert cosine.median() > 0.99 and cosine.mean() > 0.97 and low <= 1, \
        f"seed {seed}: cosine median {cosine.median():.4f}, mean {cosine.mean():.4f}, {low} positions below 0.8"


def test_narrow_grouped_output_projection_stays_dequantized(tmp_path):
    """o_lora_rank 16 (< one 128-row scale block a group): wo_a stays a dequantized GroupedLinear,
    the other e4m3 linears are kept; reference mode dequantizes everything."""
    from flashdsa.models.deepseek_v4_attention import GroupedLinear
    from flashdsa.models.linear import FP8Linear

    path = make_tiny_v4_checkpoint(tmp_path, fp8=True, seed=3)
    attn = load_v4_model(path, mode="production").model.layers[1].self_attn
    assert type(attn.o_a_proj) is GroupedLinear and attn.o_a_proj.weight.dtype == torch.bfloat16
    assert isinstance(attn.q_b_proj, FP8Linear) and isinstance(attn.compressor.indexer.q_b_proj, FP8Linear)
    assert type(attn.compressor.kv_proj) is torch.nn.Linear  # bf16 in the release
    reference = load_v4_model(path)
    assert all(t.dtype in (torch.float32, torch.int64) for t in reference.state_dict().values())


def test_fp4_experts_stay_packed_in_production(tmp_path, random_ids):
    """The release's FP4 experts load as packed bytes with UE8M0 exponent scales (a quarter of the
    bf16 bytes, scales 1/64) and compute what the dequantized model computes: FP4 values
    times powers of two are exact in bf16."""
    path = make_tiny_v4_checkpoint(tmp_path, fp4_experts=True, seed=5)
    kept = load_v4_model(path, mode="production", mtp=True)
    dequantized = load_v4_model(path, mode="production", mtp=True, keep_fp8=False)
    stored = load_file(path / "model.safetensors")
    for layer, plain in zip([*kept.model.layers, *kept.mtp], [*dequantized.model.layers, *dequantized.mtp]):
        experts, want = layer.mlp.experts, plain.mlp.experts
        assert experts.fp4 and not want.quantized
        for w, scale, bf16 in zip((experts.gate_up_proj, experts.down_proj), experts.scales(),
                                  (want.gate_up_proj, want.down_proj)):
            assert w.dtype == scale.dtype == torch.uint8 and 4 * w.nbytes == bf16.nbytes == 64 * scale.nbytes
    assert torch.equal(kept.model.layers[2].mlp.experts.down_proj[3],
                       stored["layers.2.ffn.experts.3.w2.weight"].view(torch.uint8))
    ids = random_ids(48)
    # on CPU both run fused_moe's reference on the same bf16 weight values: the same logits
    torch.testing.assert_close(kept.forward_sequence(ids).logits, dequantized.forward_sequence(ids).logits,
                               rtol=0, atol=0)


def test_fp8_release_layout_with_fp4_experts_loads_in_production(tmp_path, random_ids):
    """FP8 linears and FP4 experts together, as DeepSeek ships V4."""
    path = make_tiny_v4_checkpoint(tmp_path, fp8=True, fp4_experts=True, seed=6)
    kept = load_v4_model(path, mode="production")
    assert kept.model.layers[3].mlp.experts.fp4
    assert kept.model.layers[3].mlp.shared_experts.down_proj.weight.dtype == torch.float8_e4m3fn
    ids = random_ids(32)
    cosine = _cosine(kept.forward_sequence(ids).logits, load_v4_model(path).forward_sequence(ids).logits)
    assert cosine.mean() > 0.985 and cosine.min() > 0.8, f"cosine {cosine.mean():.4f}, {cosine.min():.4f}"
