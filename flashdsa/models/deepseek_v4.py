"""DeepSeek-V4 (model_type ``deepseek_v4``) in reference mode: plain torch, one sequence at a time.

    tokens -> embed -> copy into hc_mult streams -> layers -> hyper head -> norm -> lm_head
    layer:  h = mHC(h, attention(input_layernorm(collapse(h))))
            h = mHC(h, MoE(post_attention_layernorm(collapse(h)), token ids))   (routed + shared summed in the mHC)

Attention per layer type (sliding / CSA / HCA) is ``deepseek_v4_attention``; the MoE (hash-routed
in the first ``num_hash_layers`` layers) ``deepseek_v4_moe``; the hyper-connections
``hyper_connections``. The multi-token-prediction layer (:class:`MTPLayer`) is a sliding-window
decoder layer fed ``e_proj(enorm(embed(next token))) + h_proj(hnorm(streams))`` with its own hyper
head and norm, sharing the embedding and lm_head.

Parameter names are transformers' ``DeepseekV4ForCausalLM`` names (``model.layers.0.self_attn...``),
and ``mtp.{k}.*`` for the MTP layers. Two ways to run it:
- :meth:`DeepseekV4ForCausalLM.forward_sequence`: one sequence's next tokens and a :class:`V4Cache`
  (a fresh one: a full-sequence pass); prefill then decode steps through one cache compute what one
  pass over the whole sequence computes. fp32 reference code (the layerwise oracle; on a GPU its mHC
  runs the fused kernels of ``runtime.hyper``, equal to the torch math to ~1e-6).
- :meth:`DeepseekV4ForCausalLM.forward`: the engine's step, a flat batch of several sequences
  described by a ``BatchMetadata`` over paged caches (``deepseek_v4_paged``, ``deepseek_v4_caches``),
  in ``mode`` "reference" (fp32 pools) or "production" (FP8 MODEL1 pools, FP8 indexer). Fp32 where transformers keeps fp32 (norm
weights, hyper-connections, sinks, gate biases, compressor position biases), ``dtype`` elsewhere.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from flashdsa.models.caches import MODES
from flashdsa.models.deepseek_v4_attention import AttentionState, DeepseekV4Attention, RopeTable
from flashdsa.models.deepseek_v4_caches import V4Caches, allocate_v4_caches, bytes_per_block, bytes_per_slot
from flashdsa.models.deepseek_v4_config import SLIDING, DeepseekV4Config
from flashdsa.models.deepseek_v4_paged import StepPlan, paged_attention
from flashdsa.models.deepseek_v4_moe import DeepseekV4MoE, SharedExpert
from flashdsa.models.linear import fuse_shared_input
from flashdsa.models.hyper_connections import HyperConnection, HyperHead, RMSNorm
from flashdsa.models.rope import Rotary
from flashdsa.runtime.cache.layout_v4 import V4_HEAD_DIM, V4_ROPE_DIM
from flashdsa.runtime.cache.layout import INDEX_HEAD_DIM
from flashdsa.runtime.metadata import BatchMetadata

PRODUCTION_WIDTHS = (V4_HEAD_DIM, V4_ROPE_DIM, INDEX_HEAD_DIM)  # head_dim, qk_rope_head_dim, index_head_dim


@dataclass
class V4Cache:
    """One sequence's caches: ``length`` tokens seen, one :class:`AttentionState` per layer and per
    MTP layer (contiguous tensors; the paged FP8 layout belongs to ``flashdsa.runtime.cache``)."""

    layers: list[AttentionState]
    mtp: list[AttentionState] = field(default_factory=list)
    length: int = 0
    mtp_length: int = 0


class DecoderLayer(nn.Module):
    def __init__(self, config: DeepseekV4Config, layer_type: str, hashed: bool):
        super().__init__()
        c = config
        self.compressed = layer_type != SLIDING
        self.self_attn = DeepseekV4Attention(c, layer_type)
        self.mlp = DeepseekV4MoE(c, hashed)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        hc = (c.hidden_size, c.hc_mult, c.hc_sinkhorn_iters, c.hc_eps, c.rms_norm_eps)
        self.attn_hc, self.ffn_hc = HyperConnection(*hc), HyperConnection(*hc)

    def forward(self, h: torch.Tensor, input_ids: torch.Tensor,
                attention: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """The layer around its attention, ``attention: [T, hidden] -> [T, hidden]`` (normed input to
        output, over one sequence's cache or the engine's pools): hyper-connections, norms and MoE.
        ``h: [T, hc_mult, hidden]`` -> the same shape."""
        x, post, comb = self.attn_hc(h)
        y = attention(self.input_layernorm(x))
        h = HyperConnection.expand(y, h, post, comb)
        x, post, comb = self.ffn_hc(h)
        routed, shared = self.mlp.parts(self.post_attention_layernorm(x), input_ids)
        return HyperConnection.expand(routed, h, post, comb, extra=shared)


class MTPLayer(DecoderLayer):
    def __init__(self, config: DeepseekV4Config):
        super().__init__(config, SLIDING, hashed=False)
        c = config
        self.enorm, self.hnorm = RMSNorm(c.hidden_size, c.rms_norm_eps), RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.e_proj = nn.Linear(c.hidden_size, c.hidden_size, bias=False)
        self.h_proj = nn.Linear(c.hidden_size, c.hidden_size, bias=False)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hc_head = HyperHead(c.hidden_size, c.hc_mult, c.hc_eps, c.rms_norm_eps)

    def combine(self, embeds: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
        """``embeds: [S, hidden]`` of the next tokens, ``streams: [S, hc_mult, hidden]`` -> the layer input."""
        return self.e_proj(self.enorm(embeds)).unsqueeze(1) + self.h_proj(self.hnorm(streams))


class DeepseekV4Model(nn.Module):
    def __init__(self, config: DeepseekV4Config):
        super().__init__()
        c = config
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(c, c.layer_type(i), c.is_hash_layer(i)) for i in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hc_head = HyperHead(c.hidden_size, c.hc_mult, c.hc_eps, c.rms_norm_eps)


@dataclass
class V4Output:
    """``logits: [S, vocab]``; ``streams: [S, hc_mult, hidden]`` after the last layer (the MTP
    layer's input); ``hidden_states``: each layer's output streams, when asked for."""

    logits: torch.Tensor
    streams: torch.Tensor
    hidden_states: list[torch.Tensor] | None = None


class DeepseekV4ForCausalLM(nn.Module):
    supports_cuda_graphs = True  # the capture is checked on a GPU: tests/models/test_deepseek_v4_gpu.py
    supports_speculative = False  # a rejected draft would leave the compressor states advanced (no rollback yet)

    def __init__(self, config: DeepseekV4Config, dtype: torch.dtype = torch.float32, mtp_layers: int = 0,
                 mode: str = "reference"):
        super().__init__()
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        widths = (config.head_dim, config.qk_rope_head_dim, config.index_head_dim)
        if mode == "production" and widths != PRODUCTION_WIDTHS:
            raise ValueError(f"production mode needs (head_dim, qk_rope_head_dim, index_head_dim) = "
                             f"{PRODUCTION_WIDTHS} (the FP8 MODEL1 and indexer cache layouts), got {widths}: "
                             f"use mode='reference' for this checkpoint")
        self.config, self.mode = config, mode
        self.model = DeepseekV4Model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.mtp = nn.ModuleList(MTPLayer(config) for _ in range(mtp_layers))
        self.ropes = {"main": RopeTable(Rotary(config.rope(compressed=False))),
                      "compress": RopeTable(Rotary(config.rope(compressed=True)))}
        for name, p in self.named_parameters():
            if not keeps_fp32(name):
                p.data = p.data.to(dtype)

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    def prepare_for_inference(self) -> None:
        """Once loaded, before serving (the model runner calls it): in production mode the linear
        layers that read one input run as one GEMM each: an attention block's input projections
        (``DeepseekV4Attention.fuse_input_projections``) and a shared expert's gate and up. Reference
        mode, the layer-by-layer oracle, keeps them apart. Idempotent."""
        if self.mode != "production":
            return
        for module in self.modules():
            if isinstance(module, DeepseekV4Attention):
                module.fuse_input_projections()
            elif isinstance(module, SharedExpert):
                fuse_shared_input(module, [module.gate_proj, module.up_proj])

    @property
    def has_mtp(self) -> bool:
        """Whether a multi-token-prediction layer is loaded (the training loop trains the first)."""
        return len(self.mtp) > 0

    def new_cache(self) -> V4Cache:
        return V4Cache([AttentionState() for _ in self.model.layers], [AttentionState() for _ in self.mtp])

    def _positions(self, start: int, tokens: int) -> torch.Tensor:
        return torch.arange(start, start + tokens, device=self.device)

    def allocate_caches(self, num_blocks: int, num_slots: int) -> V4Caches:
        """Paged caches of ``num_blocks`` blocks and state for ``num_slots`` running sequences."""
        return allocate_v4_caches(self.config, self.mode == "production", num_blocks, num_slots, self.device)

    def cache_bytes_per_block(self) -> int:
        return bytes_per_block(self.config, self.mode == "production")

    def state_bytes_per_slot(self) -> int:
        return bytes_per_slot(self.config, self.mode == "production")

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, meta: BatchMetadata, caches: V4Caches) -> torch.Tensor:
        """The engine's step: ``input_ids: [T]`` int64 of the sequences ``meta`` describes (their
        state slots in ``meta.state_slots``) -> logits ``[len(meta.logits_indices), vocab]`` fp32."""
        plan = StepPlan.build(meta, self.config.sliding_window, self.mode == "production")
        x = self.model.embed_tokens(input_ids)
        h = x.unsqueeze(1).expand(-1, self.config.hc_mult, -1).contiguous()
        for layer, cache in zip(self.model.layers, caches.layers):
            h = layer(h, input_ids, lambda y: paged_attention(layer.self_attn, y, plan, cache, self.ropes))
        h = h[meta.logits_indices]
        return self.lm_head(self.model.norm(self.model.hc_head(h))).float()

    def _sequence_attention(self, layer: DecoderLayer, positions: torch.Tensor, state: AttentionState):
        """``layer``'s attention over one sequence's ``state`` at ``positions``, as a function of its input."""
        rope = self.ropes["compress" if layer.compressed else "main"]
        return lambda x: layer.self_attn(x, positions, state, rope, self.ropes["compress"])

    @torch.no_grad()
    def forward_sequence(self, input_ids: torch.Tensor, cache: V4Cache | None = None,
                         output_hidden_states: bool = False) -> V4Output:
        """``input_ids: [S]`` the sequence's next tokens (all of it when ``cache`` is None)."""
        if input_ids.dim() != 1 or input_ids.numel() == 0:
            raise ValueError(f"input_ids must be a non-empty 1-D tensor [S], got shape {list(input_ids.shape)}")
        if not 0 <= int(input_ids.min()) <= int(input_ids.max()) < self.config.vocab_size:  # reference mode may sync
            raise ValueError(f"input_ids must be token ids in [0, {self.config.vocab_size}), got "
                             f"[{int(input_ids.min())}, {int(input_ids.max())}]")
        cache = cache if cache is not None else self.new_cache()
        positions = self._positions(cache.length, input_ids.shape[0])
        x = self.model.embed_tokens(input_ids)
        h = x.unsqueeze(1).expand(-1, self.config.hc_mult, -1).contiguous()
        hidden = [] if output_hidden_states else None
        for layer, state in zip(self.model.layers, cache.layers):
            h = layer(h, input_ids, self._sequence_attention(layer, positions, state))
            if hidden is not None:
                hidden.append(h)
        cache.length += input_ids.shape[0]
        logits = self.lm_head(self.model.norm(self.model.hc_head(h)))
        return V4Output(logits.float(), h, hidden)

    @torch.no_grad()
    def mtp_forward(self, next_ids: torch.Tensor, streams: torch.Tensor, cache: V4Cache, depth: int = 0):
        """Logits ``[S, vocab]`` of the tokens after ``next_ids: [S]`` (the tokens after those whose
        last-layer ``streams: [S, hc_mult, hidden]`` come from :meth:`forward`); the MTP layer's own
        window cache lives in ``cache.mtp[depth]``."""
        layer = self.mtp[depth]
        positions = self._positions(cache.mtp_length, next_ids.shape[0])
        h = layer.combine(self.model.embed_tokens(next_ids), streams)
        h = layer(h, next_ids, self._sequence_attention(layer, positions, cache.mtp[depth]))
        cache.mtp_length += next_ids.shape[0]
        return self.lm_head(layer.norm(layer.hc_head(h))).float()

    @torch.no_grad()
    def generate_greedy(self, prompt: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
        """Greedy continuation of ``prompt: [S]``: one prefill, then one decode step per token."""
        cache = self.new_cache()
        logits = self.forward_sequence(prompt, cache).logits[-1]
        out = []
        for _ in range(max_new_tokens):
            out.append(int(logits.argmax()))
            logits = self.forward_sequence(torch.tensor(out[-1:], device=self.device), cache).logits[-1]
        return torch.tensor(out)


FP32_PARTS = ("norm.weight", "_hc.", "hc_head.", "sinks", "position_bias", "e_score_correction_bias", "tid2eid")


def keeps_fp32(name: str) -> bool:
    """Whether parameter ``name`` stays fp32 whatever the model dtype (as transformers keeps it)."""
    return any(part in name for part in FP32_PARTS)
