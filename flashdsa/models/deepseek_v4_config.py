"""DeepSeek-V4 configuration, read from a ``config.json`` (``model_type: deepseek_v4``).

Both spellings of a V4 config are read: the official release's (``compress_ratios`` per layer,
``num_hash_layers``, ``qk_rope_head_dim``, ``rope_scaling``) and transformers 5's
(``layer_types``, ``mlp_layer_types``, ``compress_rates``, ``partial_rotary_factor``,
``rope_parameters: {"main": ..., "compress": ...}``). They are folded into one schedule:
``compress_ratios[i]`` is 0 (sliding window only), the CSA ratio or the HCA ratio, and
``hash_layers`` is how many leading layers route by ``tid2eid``. Inconsistent values raise a
ValueError naming the field. :func:`model_type` tells a V4 checkpoint from a V3.2 one.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CSA, HCA = "compressed_sparse_attention", "heavily_compressed_attention"
SLIDING = "sliding_attention"
SCORING_FUNCS = ("sqrtsoftplus", "sigmoid", "softmax")


@dataclass(frozen=True)
class RopeParams:
    """What :class:`flashdsa.models.rope.Rotary` reads: rotary width, base, optional YaRN dict."""

    qk_rope_head_dim: int
    rope_theta: float
    rope_scaling: dict[str, Any] | None


@dataclass
class DeepseekV4Config:
    vocab_size: int = 129280
    hidden_size: int = 4096
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 43
    num_nextn_predict_layers: int = 1
    num_attention_heads: int = 64
    num_key_value_heads: int = 1
    head_dim: int = 512
    qk_rope_head_dim: int = 64
    q_lora_rank: int = 1024
    o_groups: int = 8
    o_lora_rank: int = 1024
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    num_experts_per_tok: int = 6
    scoring_func: str = "sqrtsoftplus"
    routed_scaling_factor: float = 1.5
    swiglu_limit: float = 10.0
    compress_ratios: list[int] = field(default_factory=list)  # per layer: 0, csa_ratio or hca_ratio
    csa_ratio: int = 4
    hca_ratio: int = 128
    hash_layers: int = 3
    sliding_window: int = 128
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    rope_scaling: dict[str, Any] | None = None  # YaRN of the compressed layers' RoPE
    max_position_embeddings: int = 1048576
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 0
    eos_token_id: int | list[int] | None = 1
    expert_dtype: str | None = None  # "fp4" in the official release
    quantization_config: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict, repr=False)  # unknown keys, kept for saving

    def __post_init__(self) -> None:
        n = self.num_hidden_layers
        if not self.compress_ratios:
            self.compress_ratios = [0] * n
        self.compress_ratios = [0 if r in (0, 1) else r for r in self.compress_ratios[:n]]
        positive = ("vocab_size", "hidden_size", "moe_intermediate_size", "num_hidden_layers", "num_attention_heads",
                    "head_dim", "q_lora_rank", "o_groups", "o_lora_rank", "n_routed_experts", "num_experts_per_tok",
                    "csa_ratio", "hca_ratio", "sliding_window", "index_n_heads", "index_head_dim", "index_topk",
                    "hc_mult", "hc_sinkhorn_iters")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if len(self.compress_ratios) != n:
            raise ValueError(f"compress_ratios must list all {n} layers (num_hidden_layers), "
                             f"got {len(self.compress_ratios)}")
        bad = sorted({r for r in self.compress_ratios if r not in (0, self.csa_ratio, self.hca_ratio)})
        if bad:
            raise ValueError(f"compress_ratios entries must be 0, {self.csa_ratio} (CSA) or {self.hca_ratio} (HCA), "
                             f"got {bad}")
        if self.csa_ratio == self.hca_ratio:
            raise ValueError(f"compress_rates: the CSA and HCA ratios must differ, both are {self.csa_ratio}")
        if self.num_key_value_heads != 1:
            raise ValueError(f"num_key_value_heads must be 1 (one shared K=V head), got {self.num_key_value_heads}")
        if not 0 < self.qk_rope_head_dim <= min(self.head_dim, self.index_head_dim) or self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim must be even and in (0, min(head_dim, index_head_dim)], "
                             f"got {self.qk_rope_head_dim}")
        if self.num_attention_heads % self.o_groups:
            raise ValueError(f"o_groups ({self.o_groups}) must divide num_attention_heads ({self.num_attention_heads})")
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ValueError(f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds n_routed_experts "
                             f"({self.n_routed_experts})")
        if not 0 <= self.hash_layers <= n:
            raise ValueError(f"num_hash_layers must be in [0, {n}], got {self.hash_layers}")
        if self.scoring_func not in SCORING_FUNCS:
            raise ValueError(f"scoring_func must be one of {SCORING_FUNCS}, got {self.scoring_func!r}")
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act must be 'silu', got {self.hidden_act!r}")
        if not self.swiglu_limit > 0:
            raise ValueError(f"swiglu_limit must be positive, got {self.swiglu_limit!r}")
        if self.n_shared_experts != 1:
            raise ValueError(f"n_shared_experts must be 1 (DeepSeek-V4 has one shared expert), got {self.n_shared_experts}")

    def layer_type(self, layer: int) -> str:
        ratio = self.compress_ratios[layer]
        return SLIDING if ratio == 0 else CSA if ratio == self.csa_ratio else HCA

    def is_hash_layer(self, layer: int) -> bool:
        return layer < self.hash_layers

    def rope(self, compressed: bool) -> RopeParams:
        """Sliding-only layers rotate with ``rope_theta`` and no scaling; CSA/HCA layers (their queries,
        keys and compressors) with ``compress_rope_theta`` and YaRN, its attention factor fixed at 1."""
        if not compressed:
            return RopeParams(self.qk_rope_head_dim, self.rope_theta, None)
        yarn = dict(self.rope_scaling or {})
        if yarn.get("type", yarn.get("rope_type")) == "yarn":
            yarn["attention_factor"] = 1.0
        return RopeParams(self.qk_rope_head_dim, self.compress_rope_theta, yarn or None)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "DeepseekV4Config":
        raw = dict(raw)
        if raw.get("model_type", "deepseek_v4") != "deepseek_v4":
            raise ValueError(f"model_type must be 'deepseek_v4', got {raw['model_type']!r}")
        n = raw.get("num_hidden_layers", cls.num_hidden_layers)
        rates = {CSA: 4, HCA: 128, **(raw.pop("compress_rates", None) or {})}
        rates[CSA] = raw.pop("compress_rate_csa", rates[CSA])
        rates[HCA] = raw.pop("compress_rate_hca", rates[HCA])
        raw["csa_ratio"], raw["hca_ratio"] = rates[CSA], rates[HCA]
        layer_types = raw.pop("layer_types", None)
        if layer_types is not None:
            ratio = {SLIDING: 0, CSA: rates[CSA], HCA: rates[HCA]}
            bad = [t for t in layer_types if t not in ratio]
            if bad:
                raise ValueError(f"layer_types entries must be one of {tuple(ratio)}, got {bad}")
            raw.setdefault("compress_ratios", [ratio[t] for t in layer_types])
        mlp_types = raw.pop("mlp_layer_types", None)
        if mlp_types is not None:
            if any(t not in ("hash_moe", "moe") for t in mlp_types) or list(mlp_types) != sorted(
                    mlp_types, key=lambda t: t != "hash_moe"):
                raise ValueError(f"mlp_layer_types must be 'hash_moe' entries followed by 'moe' entries, got {mlp_types}")
            raw.setdefault("num_hash_layers", list(mlp_types).count("hash_moe"))
        raw["hash_layers"] = raw.pop("num_hash_layers", min(n, 3) if isinstance(n, int) else 3)
        if raw.get("partial_rotary_factor") is not None and "qk_rope_head_dim" not in raw:
            raw["qk_rope_head_dim"] = int(raw.get("head_dim", cls.head_dim) * raw["partial_rotary_factor"])
        raw.pop("partial_rotary_factor", None)
        rope = raw.pop("rope_parameters", None) or {}
        if isinstance(rope.get("compress"), dict):  # transformers 5: {"main": {...}, "compress": {...}}
            raw.setdefault("rope_theta", rope.get("main", {}).get("rope_theta", cls.rope_theta))
            raw.setdefault("compress_rope_theta", rope["compress"].get("rope_theta", cls.compress_rope_theta))
            rope = rope["compress"]
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            raw.setdefault("rope_scaling", {k: v for k, v in rope.items() if k not in ("rope_theta", "partial_rotary_factor")})
        if raw.get("num_local_experts") is not None:
            raw.setdefault("n_routed_experts", raw.pop("num_local_experts"))
        expert_dtype = (raw.get("quantization_config") or {}).get("expert_dtype")
        if expert_dtype is not None:
            raw.setdefault("expert_dtype", expert_dtype)
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        known = {k: v for k, v in raw.items() if k in names}
        return cls(**known, extra={k: v for k, v in raw.items() if k not in names})

    @classmethod
    def from_json(cls, path: str | Path) -> "DeepseekV4Config":
        """Read ``path`` (a config.json, or a checkpoint directory holding one)."""
        return cls.from_dict(read_config_json(path))

    def to_dict(self) -> dict[str, Any]:
        """The official config.json form (``compress_ratios``, ``num_hash_layers``, ``rope_scaling``),
        which transformers reads as well."""
        out = {k: v for k, v in dataclasses.asdict(self).items() if k not in ("extra", "csa_ratio", "hca_ratio",
                                                                              "hash_layers") and v is not None}
        out.update(model_type="deepseek_v4", num_hash_layers=self.hash_layers,
                   compress_rates={CSA: self.csa_ratio, HCA: self.hca_ratio})
        return {**self.extra, **out}


def read_config_json(path: str | Path) -> dict[str, Any]:
    """The parsed config.json at ``path`` (the file, or a checkpoint directory holding one)."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(f"no config.json at {path}")
    return json.loads(path.read_text())


def model_type(path: str | Path) -> str:
    """``"deepseek_v4"`` or ``"deepseek_v32"``: the architecture of the checkpoint at ``path``
    (V3 and V3.2 configs are both run by the V3.2 model)."""
    kind = read_config_json(path).get("model_type", "deepseek_v32")
    return "deepseek_v4" if kind == "deepseek_v4" else "deepseek_v32"
