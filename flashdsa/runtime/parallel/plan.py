"""The memory plan of one rank, computed from config.json alone (no weight is read).

Per rank: the weight bytes of its shard (the model built on the meta device with the rank's
``Shard``, each tensor at the dtype it is loaded in, plus the MTP layers the checkpoint stores),
the KV-cache bytes per token (every rank keeps the whole latent and indexer caches: MLA has one
KV head), an activation reserve for the largest step, a reserve for CUDA graphs and the CUDA
context, and the cache tokens the rest of ``memory_fraction`` of the device holds. The reserves
are estimates (upper bounds of the step's live tensors); the engine sizes the real cache from
the free memory it measures after loading.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from flashdsa.models.caches import cache_bytes_per_block
from flashdsa.models.config import DeepseekV32Config
from flashdsa.models.deepseek_v32 import DecoderLayer, DeepseekV32ForCausalLM
from flashdsa.runtime.cache.layout import BLOCK_SIZE
from flashdsa.runtime.parallel.shard import ParallelConfig, Shard

GiB = 1 << 30
CONTEXT_RESERVE = 2 * GiB  # CUDA context, NCCL buffers, allocator slack
GRAPH_RESERVE = 1 * GiB  # captured decode graphs (their pool holds one step's activations)
LIVE_HIDDEN_COPIES = 8  # residual, normed input, attention and MLP outputs, their bf16 temporaries


@dataclass(frozen=True)
class RankPlan:
    rank: int
    weight_bytes: int
    kv_bytes_per_token: int
    activation_bytes: int
    graph_bytes: int
    device_bytes: int
    memory_fraction: float

    @property
    def cache_bytes(self) -> int:
        """What the cache may fill: the device share left after weights and reserves."""
        used = self.weight_bytes + self.activation_bytes + self.graph_bytes
        return int(self.device_bytes * self.memory_fraction) - used

    @property
    def kv_tokens(self) -> int:
        return max(0, self.cache_bytes // self.kv_bytes_per_token) // BLOCK_SIZE * BLOCK_SIZE


def _bytes(module: torch.nn.Module, model: DeepseekV32ForCausalLM) -> int:
    tensors = list(module.named_parameters()) + list(module.named_buffers())
    return sum(t.numel() * model.param_dtype(n, t.dtype).itemsize for n, t in tensors)


def weight_bytes(config: DeepseekV32Config, shard: Shard, mode: str, quantization: str | None) -> int:
    """Bytes of the rank's weights: the main model plus ``num_nextn_predict_layers`` MTP layers, each
    a MoE layer with its own projection ``eh_proj [H, 2H]``, norms, embedding and head (as stored)."""
    with torch.device("meta"):
        model = DeepseekV32ForCausalLM(config, mode, quantization, shard)
        total = _bytes(model, model)
        if config.num_nextn_predict_layers:
            layer = DecoderLayer(config, config.num_hidden_layers, quantization == "fp8", mode == "production", shard)
            hidden, itemsize = config.hidden_size, 1 if quantization == "fp8" else 2
            extra = 2 * hidden * hidden * itemsize + 3 * hidden * 2
            vocab = _bytes(model.model.embed_tokens, model) + _bytes(model.lm_head, model)
            total += config.num_nextn_predict_layers * (_bytes(layer, model) + extra + vocab)
    return total


def activation_bytes(config: DeepseekV32Config, shard: Shard, max_num_batched_tokens: int, max_num_seqs: int) -> int:
    """Upper bound of one step's live activations: hidden copies, the absorbed queries and outputs of
    the rank's heads, the experts' intermediates, and the gathered fp32 logits of the sampled rows."""
    heads = config.num_attention_heads // shard.size
    inter = config.moe_intermediate_size // (1 if shard.expert_parallel else shard.size)
    per_token = (LIVE_HIDDEN_COPIES * config.hidden_size + 2 * heads * (config.d_qk + config.kv_lora_rank)
                 + config.num_experts_per_tok * 3 * inter + config.index_n_heads * config.index_head_dim) * 2
    return max_num_batched_tokens * per_token + 2 * max_num_seqs * config.vocab_size * 4


def memory_plan(config: DeepseekV32Config, parallel: ParallelConfig, device_bytes: int, mode: str = "production",
                quantization: str | None = None, memory_fraction: float = 0.9, max_num_batched_tokens: int = 2048,
                max_num_seqs: int = 128, cuda_graphs: bool = True) -> list[RankPlan]:
    """One :class:`RankPlan` per rank. Every split divides evenly (the model refuses others), so
    all ranks hold the same shapes: rank 0's plan is computed and repeated."""
    layers = config.num_hidden_layers + config.num_nextn_predict_layers
    kv_per_token = cache_bytes_per_block(config, mode) // BLOCK_SIZE // config.num_hidden_layers * layers
    shard = Shard.planned(parallel)
    first = RankPlan(0, weight_bytes(config, shard, mode, quantization), kv_per_token,
                     activation_bytes(config, shard, max_num_batched_tokens, max_num_seqs),
                     CONTEXT_RESERVE + (GRAPH_RESERVE if cuda_graphs else 0), device_bytes, memory_fraction)
    return [replace(first, rank=r) for r in range(parallel.tensor_parallel_size)]


def format_plan(plans: list[RankPlan]) -> str:
    """A table of the plan, one row per rank, and the verdict."""
    gb = lambda b: f"{b / 1e9:8.2f}"  # noqa: E731
    lines = [f"{'rank':>4} {'weights GB':>10} {'KV B/token':>10} {'activ. GB':>9} {'graphs GB':>9} "
             f"{'cache GB':>9} {'KV tokens':>11}"]
    for p in plans:
        lines.append(f"{p.rank:>4} {gb(p.weight_bytes):>10} {p.kv_bytes_per_token:>10} {gb(p.activation_bytes):>9} "
                     f"{gb(p.graph_bytes):>9} {gb(max(p.cache_bytes, 0)):>9} {p.kv_tokens:>11,}")
    return "\n".join(lines)


def plan_problem(plans: list[RankPlan], max_model_len: int) -> str | None:
    """Why the plan cannot run (weights do not fit, or no room for one ``max_model_len`` sequence); None if it can."""
    worst = min(plans, key=lambda p: p.kv_tokens)
    if worst.cache_bytes <= 0:
        over = -worst.cache_bytes / 1e9
        return (f"rank {worst.rank}: weights {worst.weight_bytes / 1e9:.1f} GB + reserves "
                f"{(worst.activation_bytes + worst.graph_bytes) / 1e9:.1f} GB exceed {worst.memory_fraction:.0%} of "
                f"{worst.device_bytes / 1e9:.1f} GB by {over:.1f} GB: use more ranks")
    if worst.kv_tokens < max_model_len:
        return (f"rank {worst.rank}: the cache holds {worst.kv_tokens} tokens, fewer than max_model_len "
                f"{max_model_len}: lower max_model_len or use more ranks")
    return None
