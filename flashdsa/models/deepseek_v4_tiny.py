"""Tiny random DeepSeek-V4 checkpoints in the official layout, for tests and demos.

Four layers cover every layer type: sliding window + hash MoE, CSA + hash MoE, HCA + routed MoE,
CSA + routed MoE, plus one MTP layer. Widths are small (hidden 64, 16 indexer heads so exact score
ties are rare) but the window (128) and the ratios (4 and 128) are V4's, so sequences of a few
hundred tokens cross every boundary. The attention widths are V4's own (head_dim 512 with 64 RoPE
dims, indexer heads of 128: what production mode's FP8 caches take) unless ``small`` asks for
head_dim 64 with 16 RoPE dims and indexer heads of 32 (reference mode only, 5x faster tests). Weights are bf16 (fp32 where
DeepSeek keeps fp32), or with ``fp8`` e4m3 with power-of-two (ue8m0) scales per 128x128 block, as
the release stores its linears, and with ``fp4_experts`` the routed experts packed FP4 with a UE8M0
scale per 32 inputs (``runtime.fp4``), as the release stores them. transformers'
``DeepseekV4ForCausalLM`` reads the bf16 and FP8 checkpoints too.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import torch

from flashdsa.models.deepseek_v4 import DeepseekV4ForCausalLM, keeps_fp32
from flashdsa.models.deepseek_v4_config import DeepseekV4Config
from flashdsa.models.deepseek_v4_loader import official_tensors
from flashdsa.models.loader import dequantize_blocks
from flashdsa.models.tiny import save_shards
from flashdsa.models.tiny_tokenizer import save_tokenizer
from flashdsa.runtime.fp4 import quantize_fp4
from flashdsa.runtime.fp8 import E4M3
from flashdsa.runtime.gemm import GROUP, quantize_weight

TINY = dict(
    model_type="deepseek_v4", architectures=["DeepseekV4ForCausalLM"], torch_dtype="bfloat16",
    hidden_size=64, moe_intermediate_size=32, num_hidden_layers=4, num_attention_heads=4, head_dim=64,
    qk_rope_head_dim=16, q_lora_rank=32, o_groups=2, o_lora_rank=16, n_routed_experts=4, n_shared_experts=1,
    num_experts_per_tok=2, compress_ratios=[0, 4, 128, 4], num_hash_layers=2, sliding_window=128,
    index_n_heads=16, index_head_dim=32, index_topk=8, hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6,
    scoring_func="sqrtsoftplus", routed_scaling_factor=1.5, swiglu_limit=10.0, rms_norm_eps=1e-6,
    rope_theta=10000.0, compress_rope_theta=160000.0, max_position_embeddings=4096,
    rope_scaling=dict(type="yarn", factor=16, beta_fast=32, beta_slow=1, original_max_position_embeddings=256),
    num_nextn_predict_layers=1, bos_token_id=0, eos_token_id=1, tie_word_embeddings=False,
)
PRODUCTION_WIDTHS = dict(head_dim=512, qk_rope_head_dim=64, index_head_dim=128)
# Linears the release keeps in bf16 (every other 2-D weight outside the experts' FP4 is e4m3).
NOT_FP8 = ("embed.weight", "head.weight", "ffn.gate.weight", "compressor.wkv.weight", "compressor.wgate.weight",
           "weights_proj.weight")


def tiny_v4_config(vocab_size: int = 512, small: bool = False) -> DeepseekV4Config:
    return DeepseekV4Config.from_dict({**TINY, **({} if small else PRODUCTION_WIDTHS), "vocab_size": vocab_size})


def _init(name: str, shape: torch.Size, gen: torch.Generator, config: DeepseekV4Config) -> torch.Tensor:
    """O(1) activations: norms near 1, Linear ``[out, in]`` ~ N(0, 1/in), small biases and sinks
    (on the generator's device)."""
    noise = torch.randn(shape, generator=gen, device=gen.device)  # drawn for every tensor: the stream stays put
    if name.endswith("tid2eid"):
        experts = torch.rand(config.vocab_size, config.n_routed_experts, generator=gen, device=gen.device)
        return experts.argsort(-1)[:, :shape[1]]
    if name.endswith(("norm.weight", "_hc.scale", "hc_head.hc_scale")):
        return 1.0 + 0.1 * noise
    if name.endswith(("_hc.base", "hc_head.hc_base", "e_score_correction_bias")):
        return 0.1 * noise
    if name.endswith(("sinks", "position_bias")):
        return 0.5 * noise
    if name.endswith("embed_tokens.weight"):
        return noise
    return noise / math.sqrt(shape[-1])


def random_v4_weights(config: DeepseekV4Config, seed: int, device: str | torch.device = "cpu",
                      only: Callable[[str], bool] = lambda name: True, mtp_layers: int = 1) -> dict[str, torch.Tensor]:
    """The model's tensors (with ``mtp_layers`` MTP layers) whose transformers names pass ``only``,
    under the official names, bf16 but fp32 parts, made on ``device``."""
    gen = torch.Generator(device).manual_seed(seed)
    with torch.device("meta"):
        shapes = {n: t.shape for n, t in DeepseekV4ForCausalLM(config, mtp_layers=mtp_layers).state_dict().items()}
    out = {}
    for name, shape in filter(lambda item: only(item[0]), shapes.items()):
        t = _init(name, shape, gen, config)
        if t.is_floating_point():
            t = t.float() if keeps_fp32(name) else t.to(torch.bfloat16)
        out[name] = t
    return official_tensors(config, out)


def to_fp8_ue8m0(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every bf16 2-D weight but ``NOT_FP8`` as e4m3 with ``<name>.scale``: one power-of-two scale
    (float8_e8m0fnu) per 128x128 block, as the release stores them."""
    out = {}
    for name, w in weights.items():
        if w.dim() != 2 or w.dtype != torch.bfloat16 or name.endswith(NOT_FP8):
            out[name] = w
            continue
        _, scale = quantize_weight(w)
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
        out[name] = dequantize_blocks(w.float(), 1 / scale, (GROUP, GROUP)).to(E4M3)
        out[name.removesuffix(".weight") + ".scale"] = scale.to(torch.float8_e8m0fnu)
    return out


def to_fp4_experts(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The routed experts' ``w1/w2/w3`` packed FP4 (int8) with ``<name>.scale`` UE8M0 (float8_e8m0fnu)
    per row and 32 inputs, as the release stores them; the other tensors as they are."""
    out = {}
    for name, w in weights.items():
        if ".ffn.experts." in name:
            out[name], out[name.removesuffix(".weight") + ".scale"] = quantize_fp4(w)
        else:
            out[name] = w
    return out


def make_tiny_v4_checkpoint(path: str | Path, *, fp8: bool = False, fp4_experts: bool = False, seed: int = 0,
                            shards: int = 1, small: bool = False, mtp: bool = True) -> Path:
    """Write a tiny random DeepSeek-V4 checkpoint (config, official-layout weights with the MTP layer
    unless not ``mtp``, tokenizer) into ``path`` (created if missing); ``small``: the narrow attention
    (module docstring)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = tiny_v4_config(save_tokenizer(path), small)
    if fp8:
        config.quantization_config = dict(quant_method="fp8", fmt="e4m3", scale_fmt="ue8m0",
                                          activation_scheme="dynamic", weight_block_size=[GROUP, GROUP])
    if fp4_experts:
        config.expert_dtype = "fp4"
    config.num_nextn_predict_layers = int(mtp)
    weights = random_v4_weights(config, seed, mtp_layers=int(mtp))
    weights = to_fp4_experts(weights) if fp4_experts else weights
    save_shards(path, to_fp8_ue8m0(weights) if fp8 else weights, shards)
    (path / "config.json").write_text(json.dumps(config.to_dict(), indent=2))
    (path / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": 1}, indent=2))
    return path
