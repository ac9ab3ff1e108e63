"""Check of the multi-token-prediction layer against a reference built from the DeepSeek-V3 paper.

transformers' DeepseekV32 class does not run the MTP layer, so the reference is written from the
paper's equations (``models/mtp.py``) in plain torch around transformers' own decoder layer: the
checkpoint is rewritten with the MTP layer's decoder block as an extra layer N of the HF model;
a hook replaces that layer's input by ``eh_proj([enorm(embed(t_{i+1})); hnorm(norm(h_{N-1,i}))])``
and its output goes through ``shared_head.norm`` and the lm_head. flashdsa runs the main model
over the prompt (minus its last token) and then ``mtp_forward`` over the next tokens. Compared:
the MTP layer's hidden states and draft logits (cosine, max relative error, greedy agreement).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from flashdsa.check.layerwise import _cosine, _rel_err
from flashdsa.models.batch import contiguous_block_tables, step_metadata
from flashdsa.models.config import DeepseekV32Config
from flashdsa.models.deepseek_v32 import DeepseekV32ForCausalLM
from flashdsa.models.loader import read_tensors

MTP_ONLY = ("enorm.", "hnorm.", "eh_proj.", "shared_head.")  # the parts outside the decoder block


@torch.inference_mode()
def reference_mtp(path: Path, ids: torch.Tensor, device: str | torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's MTP hidden states [L-1, hidden] and draft logits [L-1, vocab] (fp32) for
    ``ids: [L]``: row i drafts token i + 2 from h_i and token i + 1."""
    from transformers import AutoModelForCausalLM

    config = DeepseekV32Config.from_json(path)
    n = config.num_hidden_layers
    main = dict(read_tensors(path, config))
    mtp = {name.removeprefix("model.mtp."): t for name, t in read_tensors(path, config, mtp=True)
           if name.startswith("model.mtp.")}
    raw = json.loads((path / "config.json").read_text())
    raw.pop("quantization_config", None)
    raw.update(num_hidden_layers=n + 1, num_nextn_predict_layers=0)
    block = {f"model.layers.{n}.{k}": t for k, t in mtp.items() if not k.startswith(MTP_ONLY)}
    with tempfile.TemporaryDirectory() as tmp:
        save_file({k: t.float().contiguous() for k, t in {**main, **block}.items()}, Path(tmp) / "model.safetensors")
        (Path(tmp) / "config.json").write_text(json.dumps(raw))
        hf = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32, attn_implementation="eager").to(device)
    w = {k: t.float().to(device) for k, t in mtp.items() if k.startswith(MTP_ONLY)}
    eps = config.rms_norm_eps

    def rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)

    embeds = hf.model.embed_tokens(ids[1:][None])  # [1, L-1, hidden]: t_{i+1}

    def mtp_input(module, args):  # layer N's input: the MTP combination of t_{i+1} and h_i
        h = hf.model.norm(args[0])
        x = torch.cat([rms(embeds, w["enorm.weight"]), rms(h, w["hnorm.weight"])], dim=-1) @ w["eh_proj.weight"].T
        return (x, *args[1:])

    out = {}
    handles = [hf.model.layers[n].register_forward_pre_hook(mtp_input),
               hf.model.layers[n].register_forward_hook(lambda m, a, o: out.setdefault("h", o[0] if isinstance(o, tuple) else o))]
    try:
        hf.model(ids[:-1][None])
    finally:
        for h in handles:
            h.remove()
    hidden = out["h"][0].float()
    return hidden, hf.lm_head(rms(hidden, w["shared_head.norm.weight"])).float()


@torch.inference_mode()
def flashdsa_mtp(model: DeepseekV32ForCausalLM, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The same as :func:`reference_mtp` from flashdsa's caches and kernels (one prefill each)."""
    n = len(ids) - 1
    table = contiguous_block_tables([n])
    caches = model.allocate_caches(int(table.max()) + 1)
    meta = step_metadata([0], [n], table, all_logits=True, device=ids.device)
    _, hidden = model(ids[:-1], meta, caches, return_hidden=True)
    out = {}
    handle = model.model.mtp.register_forward_hook(lambda m, a, o: out.setdefault("h", o))
    try:
        logits = model.mtp_forward(ids[1:], hidden, meta, caches)
    finally:
        handle.remove()
    return out["h"].float(), logits


def compare_mtp(ref: tuple[torch.Tensor, torch.Tensor], ours: tuple[torch.Tensor, torch.Tensor]) -> dict[str, float]:
    """Cosine and max relative error of the MTP hidden states and logits, and greedy agreement."""
    (ref_h, ref_logits), (h, logits) = ref, ours
    return {"hidden_cosine": _cosine(h, ref_h), "hidden_rel_err": _rel_err(h, ref_h),
            "logits_cosine": _cosine(logits, ref_logits), "logits_rel_err": _rel_err(logits, ref_logits),
            "greedy": (logits.argmax(-1) == ref_logits.argmax(-1)).float().mean().item()}


def mtp_failures(result: dict[str, float], thresholds: dict[str, float]) -> list[str]:
    """The mode's layer and logits thresholds applied to the MTP layer."""
    bad = []
    if result["hidden_rel_err"] > thresholds["layer_rel_err"]:
        bad.append(f"mtp layer: max rel err {result['hidden_rel_err']:.2e} > {thresholds['layer_rel_err']:.0e}")
    for key, limit in (("hidden_cosine", "layer_cosine"), ("logits_cosine", "logits_cosine"), ("greedy", "greedy")):
        if result[key] < thresholds[limit]:
            bad.append(f"mtp {key.replace('_', ' ')} {result[key]:.6f} < {thresholds[limit]}")
    return bad


def format_mtp(result: dict[str, float]) -> str:
    return (f"  mtp  {result['hidden_cosine']:>10.7f}  {result['hidden_rel_err']:>11.3e}   draft logits: cosine "
            f"{result['logits_cosine']:.7f}, max rel err {result['logits_rel_err']:.3e}, greedy {result['greedy']:.4f}")
