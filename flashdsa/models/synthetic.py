"""Random checkpoints at DeepSeek-V3.2's (and V4-Flash's) true widths, in the official layout, for benchmarks.

``v32_config(num_layers)`` is the official config.json (FP8, 256 experts, 128 heads) with fewer
layers; ``write_random_checkpoint`` generates every tensor on ``device`` (a GPU makes the 15B
parameters of a 4-layer model in seconds), quantizes the linear layers to e4m3 with 128x128
``weight_scale_inv`` blocks as the official checkpoint stores them, and writes one safetensors
shard per layer plus the index, and a word-level tokenizer covering the vocabulary, so the normal
loader, engine and server run it unchanged.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from flashdsa.models.config import DeepseekV32Config
from flashdsa.models.deepseek_v32 import DeepseekV32ForCausalLM
from flashdsa.models.mtp import add_mtp_layer, checkpoint_name
from flashdsa.models.tiny import init_value, to_fp8


V32_CONFIG = dict(
    model_type="deepseek_v32", architectures=["DeepseekV32ForCausalLM"], torch_dtype="bfloat16",
    vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
    num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
    qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8,
    n_group=8, topk_group=4, routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=3,
    index_n_heads=64, index_head_dim=128, index_topk=2048, hidden_act="silu", rms_norm_eps=1e-6,
    max_position_embeddings=163840, rope_theta=10000.0, tie_word_embeddings=False,
    rope_scaling=dict(type="yarn", factor=40, original_max_position_embeddings=4096, beta_fast=32, beta_slow=1,
                      mscale=1.0, mscale_all_dim=1.0),
    bos_token_id=0, eos_token_id=1, num_nextn_predict_layers=0,
    quantization_config=dict(quant_method="fp8", fmt="e4m3", activation_scheme="dynamic", scale_fmt="ue8m0",
                             weight_block_size=[128, 128]),
)


def v32_config(num_layers: int = 4, **overrides) -> dict:
    """DeepSeek-V3.2's config.json with ``num_layers`` layers (the first min(3, num_layers - 1) dense)."""
    if num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}")
    return {**V32_CONFIG, "num_hidden_layers": num_layers, "first_k_dense_replace": min(3, num_layers - 1),
            **overrides}


def write_tokenizer(path: Path, vocab_size: int) -> None:
    """A word-level tokenizer with one token ``<i>`` per id (no download; decodes every id)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({f"<{i}>": i for i in range(vocab_size)}, unk_token="<2>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<0>", "eos_token": "<1>", "unk_token": "<2>"}))


@torch.no_grad()
def write_random_checkpoint(path: str | Path, raw_config: dict, device: str | torch.device = "cpu",
                            seed: int = 0, mtp: bool = False) -> Path:
    """Write config.json, one shard per layer (FP8 where the official checkpoint is) and a tokenizer;
    ``mtp`` adds a multi-token-prediction layer (without the copies of the embedding and lm_head,
    which the loader does not read)."""
    path, device = Path(path), torch.device(device)
    path.mkdir(parents=True, exist_ok=True)
    config = DeepseekV32Config.from_dict(raw_config)
    fp8 = bool(raw_config.get("quantization_config"))
    if mtp:
        raw_config = {**raw_config, "num_nextn_predict_layers": 1}
    with torch.device("meta"):
        model = DeepseekV32ForCausalLM(config, "production")
        if mtp:
            add_mtp_layer(model)
        shapes = {checkpoint_name(n, config): t.shape for n, t in model.state_dict().items()}
    groups: dict[str, list[str]] = {}
    for name in shapes:
        parts = name.split(".")
        groups.setdefault(f"layer{int(parts[2]):03d}" if parts[1] == "layers" else "other", []).append(name)
    gen = torch.Generator(device).manual_seed(seed)

    def shards():
        for _, names in sorted(groups.items()):
            tensors = {}
            for name in names:  # the bias's noise in fp32, the rest in bf16 (half the random bytes)
                dtype = torch.float32 if name.endswith("e_score_correction_bias") else torch.bfloat16
                noise = torch.randn(shapes[name], generator=gen, device=device, dtype=dtype)
                tensors[name] = init_value(name, noise, config.num_hidden_layers)
            yield to_fp8(tensors) if fp8 else tensors

    return _write_checkpoint(path, shards(), len(groups), raw_config, config.vocab_size)


def _write_checkpoint(path: Path, shards: Iterator[dict[str, torch.Tensor]], count: int, raw_config: dict,
                      vocab_size: int) -> Path:
    """One safetensors file per dict of ``shards`` (each written to a temporary name, then renamed),
    the index, config.json and a word-level tokenizer."""
    weight_map = {}
    for i, tensors in enumerate(tqdm(shards, total=count, desc="writing random shards", unit="shard")):
        file = f"model-{i + 1:05d}-of-{count:05d}.safetensors"
        save_file({n: t.contiguous().cpu() for n, t in tensors.items()}, str(path / f"{file}.tmp"),
                  metadata={"format": "pt"})
        (path / f"{file}.tmp").rename(path / file)
        weight_map.update({n: file for n in tensors})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (path / "config.json").write_text(json.dumps(raw_config, indent=2))
    write_tokenizer(path, vocab_size)
    return path


V4_FLASH_CONFIG = dict(
    model_type="deepseek_v4", architectures=["DeepseekV4ForCausalLM"], torch_dtype="bfloat16",
    vocab_size=129280, hidden_size=4096, moe_intermediate_size=2048, num_attention_heads=64, num_key_value_heads=1,
    head_dim=512, qk_rope_head_dim=64, q_lora_rank=1024, o_groups=8, o_lora_rank=1024, n_routed_experts=256,
    n_shared_experts=1, num_experts_per_tok=6, scoring_func="sqrtsoftplus", routed_scaling_factor=1.5,
    swiglu_limit=10.0, sliding_window=128, index_n_heads=64, index_head_dim=128, index_topk=512, hc_mult=4,
    hc_sinkhorn_iters=20, hc_eps=1e-6, rms_norm_eps=1e-6, rope_theta=10000.0, compress_rope_theta=160000.0,
    rope_scaling=dict(type="yarn", factor=16, beta_fast=32, beta_slow=1, original_max_position_embeddings=65536),
    max_position_embeddings=1048576, bos_token_id=0, eos_token_id=1, tie_word_embeddings=False,
    num_nextn_predict_layers=0, expert_dtype="fp4",
    quantization_config=dict(quant_method="fp8", fmt="e4m3", scale_fmt="ue8m0", activation_scheme="dynamic",
                             weight_block_size=[128, 128]),
)
V4_LAYER_CYCLE = (0, 4, 128, 4)  # sliding, CSA, HCA, CSA: every attention type in 4 layers


def v4_flash_config(num_layers: int = 4, **overrides) -> dict:
    """DeepSeek-V4-Flash's widths with ``num_layers`` layers cycling sliding / CSA / HCA / CSA (the
    first hash-routed)."""
    if num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}")
    ratios = [V4_LAYER_CYCLE[i % len(V4_LAYER_CYCLE)] for i in range(num_layers)]
    return {**V4_FLASH_CONFIG, "num_hidden_layers": num_layers, "compress_ratios": ratios, "num_hash_layers": 1,
            **overrides}


@torch.no_grad()
def write_random_v4_checkpoint(path: str | Path, raw_config: dict, device: str | torch.device = "cpu",
                               seed: int = 0) -> Path:
    """config.json, one shard per layer (e4m3 with UE8M0 block scales where the release is FP8, when
    the config has a ``quantization_config``; the routed experts packed FP4 with UE8M0 scales per 32
    inputs under ``expert_dtype: fp4``, as the release) and a word-level tokenizer, in DeepSeek-V4's
    official layout."""
    from flashdsa.models.deepseek_v4_config import DeepseekV4Config
    from flashdsa.models.deepseek_v4_tiny import random_v4_weights, to_fp4_experts, to_fp8_ue8m0

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = DeepseekV4Config.from_dict(dict(raw_config))
    groups = [lambda n: not n.startswith("model.layers.")]
    groups += [lambda n, i=i: n.startswith(f"model.layers.{i}.") for i in range(config.num_hidden_layers)]
    fp8, fp4 = bool(raw_config.get("quantization_config")), raw_config.get("expert_dtype") == "fp4"
    shards = (random_v4_weights(config, seed + i, device, only, mtp_layers=0) for i, only in enumerate(groups))
    shards = (to_fp4_experts(t) if fp4 else t for t in shards)
    return _write_checkpoint(path, (to_fp8_ue8m0(t) if fp8 else t for t in shards), len(groups), raw_config,
                             config.vocab_size)
