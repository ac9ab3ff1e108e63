"""DeepSeek-V3.2: MLA with DeepSeek Sparse Attention, over paged caches, in MQA (absorbed) form.

One forward runs a flat batch of T tokens from several sequences (prefill chunks and decode
tokens mixed), described by an explicit ``BatchMetadata``. Per layer, for token t:

    c_q = RMSNorm(W_DQ x)                       [q_lora_rank]
    [q_nope; q_pe] = W_UQ c_q                    [H, 128] ; [H, 64]     q_pe = rope(q_pe)
    [c_kv; k_pe] = W_DKV x,  c_kv = RMSNorm(c_kv) [512] ; [64]          k_pe = rope(k_pe)
    q_lat[h] = W_UK[h]^T q_nope[h]               [H, 512]   (W_UK, W_UV: views of kv_b_proj)
    S_t = indexer top-k positions                (cache slots via the block table)
    o_lat[h] = softmax_{s in S_t}(sm_scale [q_lat; q_pe][h] . [c_kv; k_pe]_s) c_kv_s   [H, 512]
    o = W_O concat_h(W_UV[h] o_lat[h])
so keys and values are the 576-wide latent tokens themselves: one KV head, cached once per token.
RoPE is interleaved here (rotate-half in the indexer). Modes: "reference" (fp32 weights and
unquantized caches; matches transformers) and "production" (bf16 weights, FP8 caches and indexer).
With ``quantization="fp8"`` (FP8 checkpoints, or ``--quantization fp8``) the linear layers and
experts keep e4m3 weights with 128x128 block scales (``FP8_EXEMPT`` stay as they are).

The production forward is graph-capturable: it reads no device value back to the host.
"""

from __future__ import annotations

import torch
from torch import nn

from flashdsa.models.caches import (
    MODES,
    ModelCaches,
    allocate_caches,
    attention_runs,
    cache_bytes_per_block,
    dequantized_keys,
    positions_to_slots,
    store_latent,
)
from flashdsa.models.config import DeepseekV32Config
from flashdsa.models.indexer import Indexer
from flashdsa.models.linear import FusedLinear, fusion_refusal, replace_linears
from flashdsa.models.moe import MLP, MoE
from flashdsa.models.rope import RopeAt, Rotary
from flashdsa.runtime.cache.layout import INDEX_HEAD_DIM, KV_LORA_RANK, ROPE_DIM
from flashdsa.runtime.kernels import sparse_mla_decode, sparse_mla_fwd
from flashdsa.runtime.metadata import BatchMetadata
from flashdsa.runtime.norm import rms_norm
from flashdsa.runtime.parallel.layers import ParallelLMHead, VocabParallelEmbedding
from flashdsa.runtime.parallel.shard import Shard
from flashdsa.runtime.parallel.sharding import check_fp8_splits
from flashdsa.runtime.streams import branch

# Parameters kept in fp32 in production mode (as the checkpoint and transformers keep them).
FP32_PARAMS = ("e_score_correction_bias", "indexer.weights_proj.weight")
PRODUCTION_WIDTHS = (KV_LORA_RANK, ROPE_DIM, INDEX_HEAD_DIM)  # 512, 64, 128
QUANTIZATIONS = (None, "fp8")
# Linear layers that stay in floating point under FP8: those the official checkpoint keeps in
# bf16, and kv_b_proj, whose W_UK / W_UV halves the absorbed attention multiplies as batched
# per-head products (dequantized once at load, 32 MB a layer in bf16, as vLLM does).
FP8_EXEMPT = ("lm_head", "mlp.gate", "weights_proj", "kv_b_proj")


class RMSNorm(nn.Module):
    """``weight * normalize(x)`` over the last dim (``runtime.norm``: one kernel on a GPU; the
    differentiable torch expression under autograd)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.add_norm(x)[0]

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(normalize(x + residual), x + residual)``, the add fused into the norm's kernel."""
        backend = "reference" if torch.is_grad_enabled() else None
        rows = x.reshape(-1, x.shape[-1])
        y, h = rms_norm(rows, self.weight, self.eps, None if residual is None else residual.reshape(rows.shape),
                        backend=backend)
        return y.view(*x.shape[:-1], y.shape[-1]), (x if h is None else h.view(x.shape))


def absorbed_query(q_nope: torch.Tensor, q_pe: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """The 576-wide MQA query ``[q_nope[h] @ W_UK[h] ; q_pe[h]]``: ``[T, H, kv_lora_rank + rope]`` from
    ``q_nope: [T, H, nope]``, ``q_pe: [T, H, rope]``, ``w_uk: [H, nope, kv_lora_rank]``. The batched
    product writes straight into the first channels of the result (a strided view), so the 2.4 GB
    query of a 16K prefill is never copied by a concatenation."""
    T, H, rope = q_pe.shape
    q = q_pe.new_empty(T, H, w_uk.shape[-1] + rope)
    torch.bmm(q_nope.transpose(0, 1), w_uk, out=q[..., : w_uk.shape[-1]].transpose(0, 1))  # [H, T, 512] view
    q[..., w_uk.shape[-1]:] = q_pe
    return q


class MLA(nn.Module):
    """Multi-head latent attention with the indexer's sparse selection; names follow the checkpoint.

    Under tensor parallelism a rank holds ``n_heads = heads / size`` heads of q_b/kv_b/o_proj and
    all-reduces o_proj's partial sums; the latent, its caches and the indexer are whole on every rank."""

    def __init__(self, config: DeepseekV32Config, shard: Shard = Shard()):
        super().__init__()
        c = config
        self.config, self.shard = c, shard
        self.n_heads = shard.split(c.num_attention_heads, "num_attention_heads")
        self.q_a_proj = nn.Linear(c.hidden_size, c.q_lora_rank, bias=False)
        self.q_a_layernorm = RMSNorm(c.q_lora_rank, c.rms_norm_eps)
        self.q_b_proj = nn.Linear(c.q_lora_rank, self.n_heads * c.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(c.hidden_size, c.kv_lora_rank + c.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank, c.rms_norm_eps)
        self.kv_b_proj = nn.Linear(c.kv_lora_rank, self.n_heads * (c.qk_nope_head_dim + c.v_head_dim), bias=False)
        self.o_proj = nn.Linear(self.n_heads * c.v_head_dim, c.hidden_size, bias=False)
        self.indexer = Indexer(c)
        self.fused_input: FusedLinear | None = None  # see fuse_input_projections

    def fuse_input_projections(self) -> None:
        """For inference: run q_a_proj, the indexer's wk and kv_a_proj_with_mqa, which all read x, as one
        GEMM ``[q_lora_rank | index_head_dim | kv_lora_rank + rope]`` (1536 | 128 | 576 in V3.2: every
        128-row FP8 scale block stays inside one part). The three modules keep their weights as views
        (training and checkpoints use them as before). Idempotent; layers that cannot fuse stay as they are."""
        parts = [self.q_a_proj, self.indexer.wk, self.kv_a_proj_with_mqa]
        if self.fused_input is None and fusion_refusal(parts) is None:
            self.fused_input = FusedLinear(parts)

    def forward(self, x: torch.Tensor, rope: RopeAt, meta: BatchMetadata, mla_pool: torch.Tensor,
                index_pool: torch.Tensor):
        """x: [T, hidden] -> [T, hidden]; writes this step's tokens into both pools first."""
        c, T, H = self.config, x.shape[0], self.n_heads
        if self.fused_input is None:
            q_a, index_k, kv_a = self.q_a_proj(x), None, self.kv_a_proj_with_mqa(x)
        else:  # one GEMM: [T, q_lora_rank], [T, index_head_dim], [T, kv_lora_rank + rope]
            q_a, index_k, kv_a = self.fused_input(x)
        q_resid = self.q_a_layernorm(q_a)  # [T, q_lora_rank]
        # a captured decode step scores and selects (a few CTAs at small batches) beside the query path
        selection = branch(x)
        with selection.run():
            selected = self.indexer(x, q_resid, rope, meta, index_pool, index_k)  # [T, topk] positions
        q = self.q_b_proj(q_resid).view(T, H, c.qk_head_dim)
        q_nope, q_pe = q.split([c.qk_nope_head_dim, c.qk_rope_head_dim], -1)  # [T, H, 128], [T, H, 64]
        c_kv, k_pe = kv_a.split([c.kv_lora_rank, c.qk_rope_head_dim], -1)
        c_kv = self.kv_a_layernorm(c_kv)  # [T, 512]
        q_pe, k_pe = rope(q_pe, k_pe, interleaved=True)  # [T, H, 64], [T, 64]
        store_latent(mla_pool, c_kv, k_pe, meta.slot_mapping)
        w_kv_b = self.kv_b_proj.weight.view(H, c.qk_nope_head_dim + c.v_head_dim, c.kv_lora_rank)
        w_uk, w_uv = w_kv_b.split([c.qk_nope_head_dim, c.v_head_dim], dim=1)  # [H, 128, 512] each
        q = absorbed_query(q_nope, q_pe, w_uk)  # [T, H, 576]
        selection.join()
        # [t, H, v_head_dim] a run of sequences at a time (one run in most steps: no concatenation)
        parts = [torch.einsum("thc,hdc->thd", o_lat, w_uv) for o_lat in self._attend(q, mla_pool, selected, meta)]
        o = parts[0] if len(parts) == 1 else torch.cat(parts)
        return self.shard.all_reduce(self.o_proj(o.flatten(1)))

    def _attend(self, q: torch.Tensor, pool: torch.Tensor, positions: torch.Tensor,
                meta: BatchMetadata) -> list[torch.Tensor]:
        """Sparse attention of ``q: [T, H, d_qk]`` over each token's cache ``positions: [T, topk]``:
        the outputs ``[t, H, kv_lora_rank]`` of consecutive runs of tokens (``attention_runs``)."""
        scale, d_v = self.config.softmax_scale, self.config.kv_lora_rank
        if pool.dtype != torch.uint8:  # float pool (reference mode): slot ids index its rows
            kv = pool.view(-1, 1, pool.shape[-1])  # [num_blocks * 64, 1, d_qk]
            slots = positions_to_slots(positions, meta, pool.shape[1])
            return [sparse_mla_fwd(q, kv, slots[:, None, :], scale, d_v)[0]]
        outs = []
        for run in attention_runs(meta, pool.shape[1]):
            q_run, positions_run = q[run.tokens], positions[run.tokens]
            if run.dequantized:  # the forward over bf16 rows of the run's blocks
                kv, rows = dequantized_keys(pool, positions_run, meta, run, q.dtype)
                outs.append(sparse_mla_fwd(q_run, kv, rows[:, None, :], scale, d_v)[0])
            else:  # the decode kernel reads slot ids of the FP8 cache directly
                slots = positions_to_slots(positions_run, meta, pool.shape[1], run.tokens)
                outs.append(sparse_mla_decode(q_run[None], pool, slots[None], scale, d_v)[0][0])
        return outs


class DecoderLayer(nn.Module):
    def __init__(self, config: DeepseekV32Config, layer: int, fp8: bool = False, production: bool = True,
                 shard: Shard = Shard()):
        super().__init__()
        self.self_attn = MLA(config, shard)
        if config.is_moe_layer(layer):
            # Stacked gate/up blocks need whole 128-row halves; narrower (tiny) experts stay float.
            self.mlp = MoE(config, fp8, quantize_activations=production, pow2_scales=config.pow2_act_scales,
                           shard=shard)
        else:
            self.mlp = MLP(config.hidden_size, config.intermediate_size, shard)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, h: torch.Tensor, rope: RopeAt, meta: BatchMetadata, mla_pool: torch.Tensor,
                index_pool: torch.Tensor):
        attn = self.self_attn(self.input_layernorm(h), rope, meta, mla_pool, index_pool)
        x, h = self.post_attention_layernorm.add_norm(attn, h)  # h = h + attn
        return h + self.mlp(x)


class DeepseekV32Model(nn.Module):
    def __init__(self, config: DeepseekV32Config, fp8: bool = False, production: bool = True, shard: Shard = Shard()):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, shard)
        self.layers = nn.ModuleList(DecoderLayer(config, i, fp8, production, shard)
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class DeepseekV32ForCausalLM(nn.Module):
    """The model; build it with :func:`flashdsa.models.loader.load_model`. ``shard`` is this
    rank's part under tensor/expert parallelism (``flashdsa.runtime.parallel``)."""

    def __init__(self, config: DeepseekV32Config, mode: str = "production", quantization: str | None = None,
                 shard: Shard = Shard()):
        super().__init__()
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {quantization!r}")
        widths = (config.kv_lora_rank, config.qk_rope_head_dim, config.index_head_dim)
        if mode == "production" and widths != PRODUCTION_WIDTHS:
            raise ValueError(
                f"production mode needs (kv_lora_rank, qk_rope_head_dim, index_head_dim) = {PRODUCTION_WIDTHS} "
                f"(the FP8 cache layouts), got {widths}: use mode='reference' for this checkpoint"
            )
        self.config, self.mode, self.quantization, self.shard = config, mode, quantization, shard
        fp8, production = quantization == "fp8", mode == "production"
        self.model = DeepseekV32Model(config, fp8, production, shard)
        self.lm_head = ParallelLMHead(config.hidden_size, config.vocab_size, shard)
        self.rotary = Rotary(config)
        if fp8:
            names = {n for n, m in self.named_modules() if isinstance(m, nn.Linear) and not n.endswith(FP8_EXEMPT)}
            replace_linears(self, names, production, config.pow2_act_scales)
            check_fp8_splits(self, shard)

    def param_dtype(self, name: str, dtype: torch.dtype = torch.float32) -> torch.dtype:
        """Storage dtype of parameter/buffer ``name`` (now ``dtype``) in this mode: e4m3 weights and
        their fp32 scales stay as they are."""
        if dtype == torch.float8_e4m3fn or name.endswith("_scale_inv"):
            return dtype
        if self.mode == "reference" or name.endswith(FP32_PARAMS):
            return torch.float32
        return torch.bfloat16

    def prepare_for_inference(self) -> None:
        """Once loaded, before serving (the model runner calls it): in production mode each MLA runs
        its three input projections as one GEMM (:meth:`MLA.fuse_input_projections`). Reference mode,
        the layer-by-layer oracle, keeps them apart. Idempotent."""
        if self.mode == "production":
            for module in self.modules():
                if isinstance(module, MLA):
                    module.fuse_input_projections()

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def has_mtp(self) -> bool:
        """Whether the multi-token-prediction layer is loaded (``models/mtp.py``)."""
        return hasattr(self.model, "mtp")

    @property
    def num_cache_layers(self) -> int:
        """Layers with caches: the main stack, plus the MTP layer when loaded (its pools come last)."""
        return self.config.num_hidden_layers + self.has_mtp

    def allocate_caches(self, num_blocks: int) -> ModelCaches:
        return allocate_caches(self.config, self.mode, num_blocks, self.device, self.num_cache_layers)

    def cache_bytes_per_block(self) -> int:
        return cache_bytes_per_block(self.config, self.mode, self.num_cache_layers)

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, meta: BatchMetadata, caches: ModelCaches,
                return_hidden: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """input_ids: [T] int64 -> logits [len(meta.logits_indices), vocab] fp32; with
        ``return_hidden`` also every token's final-normed hidden state [T, hidden] (the MTP input)."""
        rope = self.rotary.at(meta.positions, fused=self.mode == "production")  # one kernel a rotation
        h = self.model.embed_tokens(input_ids)  # [T, hidden]
        for i, layer in enumerate(self.model.layers):
            h = layer(h, rope, meta, caches.mla[i], caches.indexer[i])
        if return_hidden:
            h = self.model.norm(h)
            return self.lm_head(h[meta.logits_indices]).float(), h
        return self.lm_head(self.model.norm(h[meta.logits_indices])).float()

    @torch.no_grad()
    def mtp_forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, meta: BatchMetadata,
                    caches: ModelCaches) -> torch.Tensor:
        """The MTP layer over a step: ``input_ids: [T]`` holds t_{i+1} for the token at position i,
        ``hidden: [T, hidden]`` the main model's h_i -> draft logits [len(meta.logits_indices), vocab]
        fp32 (predicting t_{i+2}). Writes the MTP layer's caches (the last pools). Graph-capturable."""
        mtp, last = self.model.mtp, self.config.num_hidden_layers
        rope = self.rotary.at(meta.positions, fused=self.mode == "production")
        h = mtp(mtp.combine(self.model.embed_tokens(input_ids), hidden), rope, meta, caches.mla[last],
                caches.indexer[last])
        return self.lm_head(mtp.shared_head.norm(h[meta.logits_indices])).float()
