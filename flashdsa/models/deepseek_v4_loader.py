"""Load a DeepSeek-V4 checkpoint into :class:`DeepseekV4ForCausalLM` (reference mode).

Two layouts are read (told apart by their names):

- **official** (deepseek-ai/DeepSeek-V4-*): ``embed.weight``, ``layers.{i}.attn.wq_a.weight``,
  ``layers.{i}.attn.compressor.wkv.weight``, ``layers.{i}.attn.indexer.wq_b.weight``,
  ``layers.{i}.ffn.experts.{e}.w1.weight``, ``layers.{i}.hc_attn_fn``, ``mtp.{k}.e_proj.weight``, ...
  (:data:`OFFICIAL_NAMES` maps each to the model's name); per-expert ``w1/w3`` are stacked into
  ``gate_up_proj``, ``w2`` into ``down_proj``.
- **transformers** (``model.layers.{i}.self_attn.q_a_proj.weight``, stacked experts): the model's
  own names.

Weights are bf16/fp32, or FP8 e4m3 with one scale per 128x128 block (``<name>.scale``, ue8m0 or
fp32, officially; ``<name>_scale_inv`` in transformers' layout), or for the routed experts FP4
(``expert_dtype: fp4``, as DeepSeek ships V4: e2m1 pairs packed in int8 with a UE8M0 scale per 32
inputs, ``runtime.fp4``). In reference mode (and with ``keep_fp8=False``) they are dequantized one
tensor at a time into the model's storage; :class:`V4Checkpoint` also reads any row range of a
tensor, dequantized bit for bit as the whole (each FSDP rank's rows: ``train.sharded_load``). In
production mode they stay as stored: FP8 linears run the block-scaled FP8 GEMM, the official
layout's FP8 or FP4 routed experts ``fused_moe``'s FP8 or FP4 path (``deepseek_v4_quant`` says
which modules, and the exceptions), so the model holds about the checkpoint's bytes.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from flashdsa.models.deepseek_v4 import DeepseekV4ForCausalLM
from flashdsa.models.deepseek_v4_config import DeepseekV4Config
from flashdsa.models.deepseek_v4_quant import FP4, FP8, keep_quantized, read_quantized, scale_name
from flashdsa.models.linear import SCALE_SUFFIX
from flashdsa.models.loader import check_complete, checkpoint_files, dequantize_blocks
from flashdsa.runtime.fp4 import dequantize_fp4
from flashdsa.runtime.fp8 import E4M3
from flashdsa.runtime.gemm import GROUP

logger = logging.getLogger(__name__)

_COMPRESSOR = {"wkv.weight": "kv_proj.weight", "wgate.weight": "gate_proj.weight", "ape": "position_bias",
               "norm.weight": "kv_norm.weight"}
_BLOCK = {  # official name inside a layer -> the model's
    "attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
    **{f"hc_{site}_{p}": f"{site}_hc.{p}" for site in ("attn", "ffn") for p in ("fn", "base", "scale")},
    "attn.wq_a.weight": "self_attn.q_a_proj.weight", "attn.q_norm.weight": "self_attn.q_a_norm.weight",
    "attn.wq_b.weight": "self_attn.q_b_proj.weight", "attn.wkv.weight": "self_attn.kv_proj.weight",
    "attn.kv_norm.weight": "self_attn.kv_norm.weight", "attn.wo_a.weight": "self_attn.o_a_proj.weight",
    "attn.wo_b.weight": "self_attn.o_b_proj.weight", "attn.attn_sink": "self_attn.sinks",
    **{f"attn.compressor.{k}": f"self_attn.compressor.{v}" for k, v in _COMPRESSOR.items()},
    **{f"attn.indexer.compressor.{k}": f"self_attn.compressor.indexer.{v}" for k, v in _COMPRESSOR.items()},
    "attn.indexer.wq_b.weight": "self_attn.compressor.indexer.q_b_proj.weight",
    "attn.indexer.weights_proj.weight": "self_attn.compressor.indexer.scorer.weights_proj.weight",
    "ffn.gate.weight": "mlp.gate.weight", "ffn.gate.bias": "mlp.gate.e_score_correction_bias",
    "ffn.gate.tid2eid": "mlp.gate.tid2eid",
    **{f"ffn.shared_experts.{w}.weight": f"mlp.shared_experts.{p}.weight"
       for w, p in (("w1", "gate_proj"), ("w2", "down_proj"), ("w3", "up_proj"))},
}
_HEAD = {"hc_head_fn": "hc_head.hc_fn", "hc_head_base": "hc_head.hc_base", "hc_head_scale": "hc_head.hc_scale"}
_MTP = {**{n: n for n in ("enorm.weight", "hnorm.weight", "e_proj.weight", "h_proj.weight", "norm.weight")}, **_HEAD}
_TOP = {"embed.weight": "model.embed_tokens.weight", "head.weight": "lm_head.weight", "norm.weight": "model.norm.weight",
        **{k: "model." + v for k, v in _HEAD.items()}}
_EXPERT = re.compile(r"^(layers|mtp)\.(\d+)\.ffn\.experts\.(\d+)\.(w[123])\.weight$")
_PREFIXED = re.compile(r"^(layers|mtp)\.(\d+)\.(.+)$")
# (stacked tensor, which half of gate_up_proj or None) per official expert matrix
_EXPERT_PART = {"w1": ("gate_up_proj", 0), "w3": ("gate_up_proj", 1), "w2": ("down_proj", None)}


def _prefix(kind: str, index: str) -> str:
    return f"model.layers.{index}." if kind == "layers" else f"mtp.{index}."


def model_name(name: str) -> tuple[str, int | None, int | None] | None:
    """Official checkpoint name -> ``(model name, expert or None, gate_up half or None)``; None if unknown."""
    if name in _TOP:
        return _TOP[name], None, None
    expert = _EXPERT.match(name)
    if expert:
        kind, index, e, w = expert.groups()
        stacked, half = _EXPERT_PART[w]
        return f"{_prefix(kind, index)}mlp.experts.{stacked}", int(e), half
    prefixed = _PREFIXED.match(name)
    if prefixed:
        kind, index, rest = prefixed.groups()
        own = _BLOCK.get(rest) or (_MTP.get(rest) if kind == "mtp" else None)
        if own:
            return _prefix(kind, index) + own, None, None
    return None


def official_names(config: DeepseekV4Config, model_names: list[str]) -> dict[str, str]:
    """The model's tensor names -> official names (inverse of :func:`model_name`; experts excluded)."""
    inverse = {v: k for k, v in _TOP.items()}
    for name in model_names:
        m = re.match(r"^(model\.layers|mtp)\.(\d+)\.(.+)$", name)
        if m:
            kind = "layers" if m.group(1) == "model.layers" else "mtp"
            table = {**_BLOCK, **(_MTP if kind == "mtp" else {})}
            rest = {v: k for k, v in table.items()}.get(m.group(3))
            if rest:
                inverse[name] = f"{kind}.{m.group(2)}.{rest}"
    return inverse


def official_tensors(config: DeepseekV4Config, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The model's tensors (its state dict) under the official names, each stacked expert tensor
    split into the per-expert ``w1`` / ``w3`` (the halves of ``gate_up_proj``) and ``w2``."""
    names = official_names(config, list(tensors))
    out = {}
    for name, t in tensors.items():
        if name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            prefix = name.removeprefix("model.").split(".mlp.experts.")[0] + ".ffn.experts."
            for e in range(t.shape[0]):
                if name.endswith("gate_up_proj"):
                    out[f"{prefix}{e}.w1.weight"], out[f"{prefix}{e}.w3.weight"] = t[e].chunk(2)
                else:
                    out[f"{prefix}{e}.w2.weight"] = t[e]
        else:
            out[names[name]] = t
    return {k: v.contiguous() for k, v in out.items()}


def _packed_fp4(kind: str, name: str) -> bool:
    """Whether a tensor of safetensors dtype ``kind`` is a routed expert's packed FP4 weight."""
    return kind in FP4 and ".experts." in name


def read_float(f, name: str, where: dict[str, Path], rows: slice | None = None) -> torch.Tensor:
    """Rows ``rows`` (``[start, stop)`` of dim 0; None: all) of tensor ``name`` of the open file ``f``
    as stored, or as fp32 for an e4m3 weight (with the 128-row block scales over those rows) or an
    FP4 routed expert (with the same rows of its per-32-input scales). No other row is read, and
    each element is dequantized by its own block's scale, so a part equals those rows of the whole."""
    part = f.get_slice(name)
    kind = part.get_dtype()
    fp4 = _packed_fp4(kind, name)
    t = part[() if rows is None else rows]
    if kind != FP8 and not fp4:
        return t
    scale = scale_name(name, where)
    if scale is None:
        raise ValueError(f"{'FP4' if fp4 else 'FP8'} tensor {name} has no scales ({name.removesuffix('.weight')}.scale "
                         f"or {name}_scale_inv)")
    if t.dim() != 2:
        raise ValueError(f"{'FP4' if fp4 else 'FP8'} tensor {name} is {list(t.shape)}: only 2-D quantized weights are "
                         f"dequantized (stacked quantized experts must come one per tensor, as the official layout "
                         f"stores them)")
    with safe_open(where[scale], framework="pt") as g:
        scales = g.get_slice(scale)
        if fp4:
            return dequantize_fp4(t.view(torch.uint8), scales[() if rows is None else rows])
        start, stop = (0, t.shape[0]) if rows is None else (rows.start, rows.stop)
        blocks = scales[start // GROUP: -(-stop // GROUP)]  # the 128-row blocks over rows [start, stop)
        return dequantize_blocks(t, blocks.float(), (GROUP, GROUP), (start, 0))


def _index(files: list[Path]) -> tuple[dict[str, Path], dict[str, str]]:
    """Checkpoint name -> the file holding it, and -> its safetensors dtype ("F8_E4M3", "BF16", ...)."""
    where, kinds = {}, {}
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                where[name], kinds[name] = file, f.get_slice(name).get_dtype()
    return where, kinds


class V4Checkpoint:
    """The safetensors files of a DeepSeek-V4 checkpoint directory, where each tensor lies, its
    dtype and which tensors are scales: what the one-process load (:func:`load_v4_model`) and the
    per-rank FSDP load (``flashdsa.train.sharded_load``) walk, one file at a time."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.files = checkpoint_files(self.path)
        self.where, self.kinds = _index(self.files)
        self.scales = {s for n in self.where if (s := scale_name(n, self.where))}

    def weights(self, names: set[str], mtp: bool, progress: bool = True):
        """Yield ``(open file, checkpoint name, (model name, expert or None, gate_up half or None))``
        for every weight (its scales go with it), the target None when ``names`` (the model's
        tensors) has no place for it; the MTP layers' only with ``mtp`` (skipped ones logged)."""
        skipped = 0
        for file in tqdm(self.files, desc="loading shards", unit="file", leave=False, disable=not progress):
            with safe_open(file, framework="pt") as f:
                for name in sorted(f.keys()):
                    if name in self.scales:
                        continue
                    if name.startswith("mtp.") and not mtp:
                        skipped += 1
                        continue
                    target = (name, None, None) if name in names else model_name(name)  # transformers layout: as is
                    yield f, name, target if target is not None and target[0] in names else None
        if skipped:
            logger.info("skipped %d tensors of the multi-token-prediction layer(s) (not loaded)", skipped)

    def shape(self, f, name: str) -> list[int]:
        """The shape of tensor ``name`` of the open file ``f`` as :meth:`read` gives it (from its
        header: a packed FP4 weight holds two values a byte)."""
        part = f.get_slice(name)
        shape = list(part.get_shape())
        return [*shape[:-1], 2 * shape[-1]] if _packed_fp4(part.get_dtype(), name) else shape

    def read(self, f, name: str, rows: slice | None = None) -> torch.Tensor:
        """Rows ``rows`` (None: all) of weight ``name`` of the open file ``f``, dequantized (:func:`read_float`)."""
        return read_float(f, name, self.where, rows)


def read_dequantized(path: str | Path):
    """Yield ``(name, tensor)`` for every tensor of the checkpoint directory ``path`` as stored (its
    own names), FP8 and FP4 weights dequantized to fp32 and their scale tensors left out: a
    checkpoint any reader of bf16/fp32 weights takes (the layerwise check's transformers model)."""
    checkpoint = V4Checkpoint(path)
    for file in checkpoint.files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                if name not in checkpoint.scales:
                    yield name, checkpoint.read(f, name)


def _slot(stack: torch.Tensor, expert: int | None, half: int | None) -> torch.Tensor:
    """The rows of ``stack`` (a weight or its scales) one checkpoint tensor fills."""
    if expert is None:
        return stack
    rows = stack[expert]
    return rows if half is None else rows.chunk(2)[half]


def piece(name: str, expert: int | None = None, half: int | None = None) -> str:
    """The name of what one checkpoint tensor fills of model tensor ``name``: all of it, or expert
    ``expert`` (and gate_up half ``half``) of a stacked one."""
    return name if expert is None else f"{name}[{expert}]{'' if half is None else half}"


def pieces(name: str, shape: torch.Size) -> dict[str, tuple[int | None, int | None]]:
    """What must be loaded to fill model tensor ``name`` of ``shape``, each :func:`piece` -> its
    ``(expert, half)``: the tensor whole, or each expert (and half) of a stacked one."""
    if name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.gate_up_proj" + SCALE_SUFFIX)):
        return {piece(name, e, h): (e, h) for e in range(shape[0]) for h in (0, 1)}
    if name.endswith(("mlp.experts.down_proj", "mlp.experts.down_proj" + SCALE_SUFFIX)):
        return {piece(name, e): (e, None) for e in range(shape[0])}
    return {name: (None, None)}


def filled(name: str, shape: torch.Size, expert: int | None, half: int | None) -> set[str]:
    """The :func:`pieces` of model tensor ``name`` (of its whole ``shape``) that one checkpoint
    tensor fills: expert ``expert`` (and half ``half``) of a stack, or, with no expert, all of them."""
    return set(pieces(name, shape)) if expert is None else {piece(name, expert, half)}


def load_v4_model(path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
                  mtp: bool = False, mode: str = "reference", keep_fp8: bool = True) -> DeepseekV4ForCausalLM:
    """Build :class:`DeepseekV4ForCausalLM` from the checkpoint directory ``path`` (either layout)
    in ``mode`` ("reference": fp32 by default, every weight dequantized; "production": bf16 by
    default, FP8 caches, and FP8 linears and FP8/FP4 routed experts kept as stored unless
    ``keep_fp8`` is False); ``mtp`` also loads its multi-token-prediction layers. Raises
    ValueError naming every missing, unexpected or mis-shaped tensor."""
    path = Path(path)
    config = DeepseekV4Config.from_json(path)
    if mtp and config.num_nextn_predict_layers < 1:
        raise ValueError(f"checkpoint {path} has no multi-token-prediction layer (num_nextn_predict_layers 0)")
    with torch.device("meta"):
        dtype = dtype or (torch.bfloat16 if mode == "production" else torch.float32)
        model = DeepseekV4ForCausalLM(config, dtype, config.num_nextn_predict_layers if mtp else 0, mode)
    checkpoint = V4Checkpoint(path)
    where = checkpoint.where
    if mode == "production" and keep_fp8:
        names = set(model.state_dict())

        def own(name: str) -> str | None:
            return name if name in names else (model_name(name) or (None,))[0]
        with torch.device("meta"):
            keep_quantized(model, checkpoint.kinds, where, [n for n in where if _EXPERT.match(n)], own)
    model.to_empty(device=device)
    dests = model.state_dict(keep_vars=True)
    loaded, unexpected, misshaped = set(), [], []
    for f, name, target in checkpoint.weights(set(dests), mtp):
        if target is None:
            unexpected.append(name)
            continue
        own, expert, half = target
        parts = {own: _slot(dests[own].data, expert, half)}  # model tensor -> the rows to fill
        if parts[own].dtype in (E4M3, torch.uint8):  # kept FP8 / FP4: the stored rows and their scales
            parts[own + SCALE_SUFFIX] = _slot(dests[own + SCALE_SUFFIX].data, expert, half)
            tensors = read_quantized(f, name, where, *parts.values())
        else:
            tensors = (checkpoint.read(f, name),)
        bad = [f"{list(d.shape)}, got {list(t.shape)}" for d, t in zip(parts.values(), tensors) if d.shape != t.shape]
        if bad:
            misshaped.append(f"{name}: expected {bad[0]}")
            continue
        for (part, dest), t in zip(parts.items(), tensors):
            dest.copy_(t.to(device))
            loaded |= filled(part, dest.shape, expert, half)
    expected = {p for n, t in dests.items() for p in pieces(n, t.shape)}
    check_complete(path, expected, loaded, unexpected, misshaped, "DeepSeek-V4")
    return model.eval()
