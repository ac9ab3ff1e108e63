"""Tiny random DeepSeek-V3.2 checkpoints in Hugging Face layout, for tests, demos and GPU checks.

The default keeps V3.2's attention widths (kv_lora_rank 512, qk_rope_head_dim 64, so d_qk 576;
index_head_dim 128) with few heads, so the FP8 caches and GPU kernels serve it; ``shrink=True``
shrinks every width for fast CPU tests (reference mode only). Three (shrunk: two) layers: the
first dense, the rest MoE. Weights are bf16 (``fp8=True``: e4m3 with 128x128 block scales, as the
official checkpoint) with scales that keep activations near unit size and each layer's update a fraction of the
residual stream, as in trained models.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

from flashdsa.models.config import DeepseekV32Config
from flashdsa.models.deepseek_v32 import DeepseekV32ForCausalLM
from flashdsa.models.mtp import add_mtp_layer, checkpoint_tensors
from flashdsa.models.tiny_tokenizer import save_tokenizer
from flashdsa.runtime.gemm import GROUP, quantize_weight

# Weights the official FP8 checkpoint keeps in bf16 (everything else 2-D is e4m3).
NOT_FP8 = ("embed_tokens.weight", "lm_head.weight", "mlp.gate.weight", "weights_proj.weight")
RESIDUAL_OUT = ("o_proj.weight", "down_proj.weight")

COMMON = dict(
    model_type="deepseek_v32", architectures=["DeepseekV32ForCausalLM"], torch_dtype="bfloat16",
    qk_nope_head_dim=128, v_head_dim=128, n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
    routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=1, index_topk=64, hidden_act="silu",
    rms_norm_eps=1e-6, max_position_embeddings=4096, rope_theta=10000.0, tie_word_embeddings=False,
    rope_scaling=dict(type="yarn", factor=4.0, original_max_position_embeddings=1024, beta_fast=32, beta_slow=1,
                      mscale=1.0, mscale_all_dim=1.0),
    bos_token_id=0, eos_token_id=1, num_nextn_predict_layers=0,
)
FULL = dict(hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_hidden_layers=3,
            num_attention_heads=16, q_lora_rank=256, kv_lora_rank=512, qk_rope_head_dim=64,
            n_routed_experts=8, index_n_heads=16, index_head_dim=128)
SHRUNK = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
              num_attention_heads=2, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16,
              v_head_dim=16, n_routed_experts=4, index_n_heads=16, index_head_dim=32)


def tiny_config(shrink: bool = False, vocab_size: int = 512) -> DeepseekV32Config:
    """The config of a tiny checkpoint."""
    return DeepseekV32Config.from_dict({**COMMON, **(SHRUNK if shrink else FULL), "vocab_size": vocab_size})


def init_value(name: str, noise: torch.Tensor, num_layers: int) -> torch.Tensor:
    """Checkpoint tensor ``name`` from standard-normal ``noise`` of its shape, with O(1)
    activations: norms near 1, small biases and correction biases (fp32), a Linear ``[out, in]``
    ~ N(0, 1/in), the residual branches' outputs scaled down as in GPT-2; bf16 but the bias."""
    if name.endswith("e_score_correction_bias"):
        return (0.05 * noise).float()
    if name.endswith("norm.weight"):
        w = 1.0 + 0.1 * noise
    elif name.endswith("norm.bias"):
        w = 0.1 * noise
    elif name.endswith("embed_tokens.weight"):
        w = noise
    else:
        w = noise / math.sqrt(noise.shape[1])
        if name.endswith(RESIDUAL_OUT):
            w = w / math.sqrt(2 * num_layers)
    return w.to(torch.bfloat16)


def random_weights(config: DeepseekV32Config, seed: int, mtp: bool = False) -> dict[str, torch.Tensor]:
    """Every tensor the model expects (with ``mtp``, the MTP layer's too, under the checkpoint's
    names), bf16 (the correction bias fp32), with O(1) activations."""
    gen = torch.Generator().manual_seed(seed)
    with torch.device("meta"):
        model = DeepseekV32ForCausalLM(config, "reference")
        if mtp:
            add_mtp_layer(model)
        shapes = {name: t.shape for name, t in model.state_dict().items()}
    out = {}
    for name, shape in shapes.items():
        noise = torch.randn(shape, generator=gen)
        out[name] = init_value(name, noise, config.num_hidden_layers)
    return checkpoint_tensors(model, out)


def to_fp8(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The checkpoint tensors as the official FP8 checkpoint stores them: every 2-D weight but
    ``NOT_FP8`` e4m3 with its 128x128 ``weight_scale_inv`` blocks."""
    out = {}
    for name, w in weights.items():
        if w.dim() == 2 and not name.endswith(NOT_FP8):
            out[name], out[name + "_scale_inv"] = quantize_weight(w)
        else:
            out[name] = w
    return out


def save_shards(path: Path, tensors: dict[str, torch.Tensor], shards: int) -> None:
    """``model.safetensors``, or ``shards`` files plus ``model.safetensors.index.json``."""
    if shards == 1:
        save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
        return
    names = list(tensors)
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = names[i * len(names) // shards : (i + 1) * len(names) // shards]
        save_file({n: tensors[n] for n in part}, path / file, metadata={"format": "pt"})
        weight_map.update({n: file for n in part})
    size = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": size}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def make_tiny_checkpoint(path: str | Path, *, fp8: bool = False, seed: int = 0, shrink: bool = False,
                         shards: int = 1, mtp: bool = False) -> Path:
    """Write a tiny random DeepSeek-V3.2 checkpoint (config, weights, tokenizer) into ``path``
    (created if missing; files of the same names are replaced); ``mtp`` adds a
    multi-token-prediction layer in the official layout."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    vocab_size = save_tokenizer(path)
    config = tiny_config(shrink, vocab_size)
    if fp8:
        config.quantization_config = dict(quant_method="fp8", fmt="e4m3", activation_scheme="dynamic",
                                          weight_block_size=[GROUP, GROUP])
    config.num_nextn_predict_layers = int(mtp)
    weights = random_weights(config, seed, mtp)
    save_shards(path, to_fp8(weights) if fp8 else weights, shards)
    (path / "config.json").write_text(json.dumps(config.to_dict(), indent=2))
    (path / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": 1}, indent=2))
    return path
