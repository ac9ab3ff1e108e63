"""The multi-token-prediction (MTP) layer of DeepSeek-V3 / V3.2: a draft of the token after next.

For position i, with h_i the main model's last hidden state (after its final norm, as vLLM and
SGLang feed it) and t_{i+1} the token that follows:

    x_i = W_eh [RMSNorm_e(embed(t_{i+1})) ; RMSNorm_h(h_i)]          [hidden]    (eh_proj: 2*hidden -> hidden)
    g_i = DecoderLayer(x_i)     one full layer: MLA with its own indexer and caches, MoE or dense
    p(t_{i+2}) = softmax(lm_head(RMSNorm_s(g_i)))                    the main model's lm_head

The checkpoint stores it after the main stack as ``model.layers.{num_hidden_layers}.*``
(``enorm``, ``hnorm``, ``eh_proj``, the decoder layer, ``shared_head.norm``) plus copies of the
embedding and lm_head (``embed_tokens``, ``shared_head.head``) that equal the main model's: the
model holds the layer as ``model.mtp`` and shares the main embedding and head, so the loader skips
the copies and ``save_model`` writes them back. Only the first MTP layer is used (V3.2 ships one).
"""

from __future__ import annotations

import re

import torch
from torch import nn

from flashdsa.models.config import DeepseekV32Config
from flashdsa.models.deepseek_v32 import FP8_EXEMPT, DecoderLayer, RMSNorm
from flashdsa.models.linear import replace_linears
from flashdsa.runtime.parallel.shard import Shard
from flashdsa.runtime.parallel.sharding import check_fp8_splits

MTP_PREFIX = "mtp."
# in the checkpoint, not the model: the MTP layer's copies of the main embedding and lm_head
SHARED_COPY_OF = {"embed_tokens.weight": "model.embed_tokens.weight", "shared_head.head.weight": "lm_head.weight"}
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.*)$")


class SharedHead(nn.Module):
    """The MTP layer's own final norm (the projection is the main lm_head)."""

    def __init__(self, config: DeepseekV32Config):
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class MTPLayer(DecoderLayer):
    """One MTP depth; its decoder layer is built as layer ``num_hidden_layers`` (MoE in V3.2)."""

    def __init__(self, config: DeepseekV32Config, fp8: bool = False, production: bool = True, shard: Shard = Shard()):
        super().__init__(config, config.num_hidden_layers, fp8, production, shard)
        self.enorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hnorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False)
        self.shared_head = SharedHead(config)

    def combine(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """``embeds``: [T, hidden] of t_{i+1}, ``hidden``: [T, hidden] h_i -> the layer input x_i [T, hidden]."""
        return self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden.to(embeds.dtype))], dim=-1))


def add_mtp_layer(model: nn.Module) -> MTPLayer:
    """Give ``model`` (a ``DeepseekV32ForCausalLM``) an MTP layer as ``model.model.mtp``, on the
    model's device (meta included) with uninitialised weights; sets ``num_nextn_predict_layers``."""
    config = model.config
    fp8, production = model.quantization == "fp8", model.mode == "production"
    with torch.device(model.lm_head.weight.device):
        layer = MTPLayer(config, fp8, production, model.shard)
    if fp8:
        names = {n for n, m in layer.named_modules() if isinstance(m, nn.Linear) and not n.endswith(FP8_EXEMPT)}
        replace_linears(layer, names, production, config.pow2_act_scales)
        check_fp8_splits(layer, model.shard)
    for name, t in list(layer.named_parameters()) + list(layer.named_buffers()):
        t.data = t.data.to(model.param_dtype(name, t.dtype))
    model.model.mtp = layer
    config.num_nextn_predict_layers = max(config.num_nextn_predict_layers, 1)
    return layer


def model_name(checkpoint_name: str, config: DeepseekV32Config) -> str | None:
    """The model's name for an MTP checkpoint tensor (``model.layers.{N}.x`` -> ``model.mtp.x``);
    None for tensors the model does not hold (the shared copies, deeper MTP layers); other names as is."""
    match = _LAYER.match(checkpoint_name)
    if not match or int(match.group(1)) < config.num_hidden_layers:
        return checkpoint_name
    if int(match.group(1)) > config.num_hidden_layers or match.group(2) in SHARED_COPY_OF:
        return None
    return "model." + MTP_PREFIX + match.group(2)


def checkpoint_name(name: str, config: DeepseekV32Config) -> str:
    """The checkpoint's name for the model's tensor ``name`` (``model.mtp.x`` -> ``model.layers.{N}.x``)."""
    if name.startswith("model." + MTP_PREFIX):
        return f"model.layers.{config.num_hidden_layers}." + name.removeprefix("model." + MTP_PREFIX)
    return name


def checkpoint_tensors(model: nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The model's ``tensors`` (state-dict names) renamed to the checkpoint layout, with the MTP
    layer's copies of the embedding and lm_head added, as the official checkpoint stores them."""
    prefix = f"model.layers.{model.config.num_hidden_layers}."
    out = {checkpoint_name(name, model.config): t for name, t in tensors.items()}
    if any(name.startswith("model." + MTP_PREFIX) for name in tensors):
        out.update((prefix + copy, tensors[main].clone()) for copy, main in SHARED_COPY_OF.items())
    return out
