"""DeepSeek-V3.2 configuration, read from a Hugging Face ``config.json``.

Field names are the checkpoint's own (``n_routed_experts``, ``index_topk``, ...). RoPE settings
come either in the original form (``rope_theta`` + ``rope_scaling``) or in transformers 5's
``rope_parameters``; both are folded into ``rope_theta`` and ``rope_scaling`` here.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class DeepseekV32Config:
    vocab_size: int = 129280
    hidden_size: int = 7168
    intermediate_size: int = 18432
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 61
    num_nextn_predict_layers: int = 0  # MTP layers stored after the main stack; not run here
    num_attention_heads: int = 128
    q_lora_rank: int = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    num_experts_per_tok: int = 8
    n_group: int = 8
    topk_group: int = 4
    routed_scaling_factor: float = 2.5
    norm_topk_prob: bool = True
    first_k_dense_replace: int = 3
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 2048
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 163840
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # YaRN: factor, mscale, mscale_all_dim, beta_*, ...
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 0
    eos_token_id: int | list[int] | None = 1
    quantization_config: dict[str, Any] | None = None  # FP8 checkpoints: weight_block_size [128, 128]
    extra: dict[str, Any] = field(default_factory=dict, repr=False)  # unknown keys, kept for saving

    def __post_init__(self) -> None:
        if self.q_lora_rank is None:
            raise ValueError("q_lora_rank must be set: DeepSeek-V3.2 always projects q through a low-rank latent")
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act must be 'silu', got {self.hidden_act!r}")
        if self.n_routed_experts % self.n_group:
            raise ValueError(f"n_routed_experts ({self.n_routed_experts}) must be a multiple of n_group ({self.n_group})")
        if self.qk_rope_head_dim > self.index_head_dim:
            raise ValueError("qk_rope_head_dim must not exceed index_head_dim (the indexer ropes its first dims)")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def d_qk(self) -> int:
        """Width of one absorbed (MQA) query/key: latent + RoPE (576 for V3.2)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """qk_head_dim^-0.5, times mscale^2 under YaRN (mscale = 0.1 * mscale_all_dim * ln(factor) + 1)."""
        scale = self.qk_head_dim**-0.5
        yarn = self.rope_scaling or {}
        mscale_all_dim = yarn.get("mscale_all_dim") or 0
        factor = yarn.get("factor") or 1.0
        if yarn.get("type", yarn.get("rope_type")) == "yarn" and mscale_all_dim and factor > 1:
            mscale = 0.1 * mscale_all_dim * math.log(factor) + 1.0
            scale *= mscale * mscale
        return scale

    @property
    def weight_block_size(self) -> tuple[int, int] | None:
        """Block of one ``weight_scale_inv`` entry for FP8 checkpoints, else None."""
        q = self.quantization_config
        if not q:
            return None
        return tuple(q.get("weight_block_size", (128, 128)))

    @property
    def pow2_act_scales(self) -> bool:
        """Whether FP8 activations take power-of-two scales (``scale_fmt: ue8m0``, as DeepSeek-V3.2 ships)."""
        return (self.quantization_config or {}).get("scale_fmt") == "ue8m0"

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "DeepseekV32Config":
        raw = dict(raw)
        if raw.get("model_type", "deepseek_v32") not in ("deepseek_v32", "deepseek_v3"):
            raise ValueError(f"a {raw['model_type']!r} model: flashdsa runs DeepSeek-V3.2 checkpoints "
                             f"(config.json model_type 'deepseek_v32')")
        rope = raw.pop("rope_parameters", None)
        if rope:  # transformers 5 form: one dict holding theta and the scaling
            raw.setdefault("rope_theta", rope.get("rope_theta", 10000.0))
            if rope.get("rope_type", "default") != "default":
                raw.setdefault("rope_scaling", {k: v for k, v in rope.items() if k != "rope_theta"})
        if raw.get("num_local_experts") is not None:
            raw.setdefault("n_routed_experts", raw.pop("num_local_experts"))
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        known = {k: v for k, v in raw.items() if k in names}
        return cls(**known, extra={k: v for k, v in raw.items() if k not in names})

    @classmethod
    def from_json(cls, path: str | Path) -> "DeepseekV32Config":
        """Read ``path`` (a config.json, or a checkpoint directory holding one)."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise ValueError(f"no config.json at {path}")
        return cls.from_dict(json.loads(path.read_text()))

    def to_dict(self) -> dict[str, Any]:
        """The config.json form (original DeepSeek key names). ``num_key_value_heads`` is
        transformers' multi-head view of MLA (one K/V head per query head): without it, its eager
        attention reads a different head count and fails."""
        out = {k: v for k, v in dataclasses.asdict(self).items() if k != "extra" and v is not None}
        return {**self.extra, **out, "num_key_value_heads": self.num_attention_heads}
