"""Layer-by-layer comparison of flashdsa's DeepSeek-V3.2 or V4 with Hugging Face ``transformers``.

Both models run the same tokens as one prefill. Per layer: cosine and max relative error
(``max|a - b| / max|b|``) of the hidden states (V4: the hyper-connection streams), and the
indexer's top-k recall (the share of HF's causal choices that flashdsa also picked; V4: of the
compressed entries, in its CSA layers). A choice that differs only between positions whose
scores are exactly tied is a *tie swap*: it counts as agreement in the recall, and since it
legitimately changes what that token attends to, reference mode compares hidden states and
logits on the tokens before the first tie swap. Then the final logits: cosine, relative error,
greedy (argmax) agreement.
"""

from __future__ import annotations

import json
import logging
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from flashdsa.models.batch import contiguous_block_tables, step_metadata
from flashdsa.models.loader import read_tensors
from flashdsa.runtime.model_runner import ModelRunner

logger = logging.getLogger(__name__)

# Pass thresholds per mode. Reference: fp32 everywhere, must match to rounding. Production (bf16
# weights, FP8 caches and indexer): measured on the tiny checkpoints, with margin (see README).
THRESHOLDS = {
    "reference": dict(layer_rel_err=1e-4, layer_cosine=0.99999, recall=1.0, logits_cosine=0.99999, greedy=1.0),
    "production": dict(layer_rel_err=float("inf"), layer_cosine=0.985, recall=0.9, logits_cosine=0.985, greedy=0.75),
}
TIE_TOL = 1e-5  # scores within TIE_TOL * max|row| of the k-th best count as tied


@dataclass
class Run:
    """One model's outputs on T tokens: per-layer hidden states [T, ...]; per layer with an indexer
    (by layer index), its top-k choice [T, k] (-1 padded) and the scores [T, T] it chose from where
    the model exposes them (V3.2 reference mode); logits [T, vocab]."""

    hidden: list[torch.Tensor] = field(default_factory=list)
    topk: dict[int, torch.Tensor] = field(default_factory=dict)
    scores: dict[int, torch.Tensor] = field(default_factory=dict)
    logits: torch.Tensor | None = None


@dataclass
class LayerReport:
    cosine: float
    rel_err: float
    recall: float | None  # None: the layer has no indexer (V4 sliding-window and HCA layers)
    tie_swaps: int  # tokens whose choice differs from HF's only among exactly tied scores (reference)


@dataclass
class Report:
    layers: list[LayerReport]
    logits_cosine: float
    logits_rel_err: float
    greedy: float
    rows: int  # tokens compared (before the first tie swap)
    tokens: int

    def failures(self, mode: str) -> list[str]:
        t = THRESHOLDS[mode]
        bad = []
        for i, r in enumerate(self.layers):
            if r.rel_err > t["layer_rel_err"]:
                bad.append(f"layer {i}: max rel err {r.rel_err:.2e} > {t['layer_rel_err']:.0e}")
            if r.cosine < t["layer_cosine"]:
                bad.append(f"layer {i}: cosine {r.cosine:.6f} < {t['layer_cosine']}")
            if r.recall is not None and r.recall < t["recall"]:
                bad.append(f"layer {i}: top-k recall {r.recall:.4f} < {t['recall']}")
        if self.logits_cosine < t["logits_cosine"]:
            bad.append(f"logits cosine {self.logits_cosine:.6f} < {t['logits_cosine']}")
        if self.greedy < t["greedy"]:
            bad.append(f"greedy agreement {self.greedy:.4f} < {t['greedy']}")
        return bad


def load_hf_reference(path: Path, device: str | torch.device):
    """transformers' DeepseekV32ForCausalLM (or DeepseekV4ForCausalLM) in fp32 (eager attention).
    An FP8 (V4: or FP4-expert) checkpoint is first dequantized into a temporary copy, as
    transformers needs extra packages for FP8 on CPU. A config without ``num_key_value_heads``
    (transformers' MHA view of MLA) gets one per query head."""
    from transformers import AutoModelForCausalLM

    from flashdsa.models.deepseek_v4_loader import read_dequantized

    raw = json.loads((path / "config.json").read_text())
    options = dict(dtype=torch.float32, attn_implementation="eager",
                   num_key_value_heads=raw.get("num_key_value_heads", raw["num_attention_heads"]))
    if "quantization_config" not in raw and "expert_dtype" not in raw:
        return AutoModelForCausalLM.from_pretrained(path, **options).to(device)
    tensors = read_dequantized(path) if raw.get("model_type") == "deepseek_v4" else read_tensors(path)
    with tempfile.TemporaryDirectory() as tmp:
        save_file({n: (t.float() if t.is_floating_point() else t).contiguous() for n, t in tensors},
                  Path(tmp) / "model.safetensors")
        raw.pop("quantization_config", None)
        raw.pop("expert_dtype", None)
        (Path(tmp) / "config.json").write_text(json.dumps(raw))
        model = AutoModelForCausalLM.from_pretrained(tmp, **options)
    return model.to(device)


def _record(run: Run, key: str, layer: int = -1):
    def hook(module, inputs, output):
        out = (output[0] if isinstance(output, tuple) else output).squeeze(0)
        if key == "scores":  # the logits the top-k chose from (not seen when a fused top-k runs)
            run.scores[layer] = inputs[0].float()
        elif key == "topk":
            run.topk[layer] = out
        else:
            run.hidden.append(out.float())
    return hook


def _hooks(model: torch.nn.Module, suffix: str, run: Run, key: str) -> list:
    """Hooks recording ``key`` from the main layers' modules whose names end with ``suffix``."""
    return [m.register_forward_hook(_record(run, key, int(name.split(".")[2]))) for name, m in model.named_modules()
            if name.startswith("model.layers.") and name.endswith(suffix)]


@torch.inference_mode()
def run_hf(hf, ids: torch.Tensor) -> Run:
    run = Run()
    handles = [layer.register_forward_hook(_record(run, "hidden")) for layer in hf.model.layers]
    handles += _hooks(hf, ".indexer", run, "topk")
    try:
        run.logits = hf(ids[None], use_cache=False).logits[0].float()
    finally:
        for h in handles:
            h.remove()
    return run


@torch.inference_mode()
def run_flashdsa(model: torch.nn.Module, ids: torch.Tensor) -> Run:
    """Our model (V3.2 or V4) on ``ids`` as one prefill through a runner; V4 records no scores, so
    its reference mode recognises no tie swaps."""
    run = Run()
    handles = [layer.register_forward_hook(_record(run, "hidden")) for layer in model.model.layers]
    handles += _hooks(model, "self_attn.indexer", run, "topk") + _hooks(model, "indexer.choice", run, "topk")
    handles += _hooks(model, "indexer.topk", run, "scores")
    table = contiguous_block_tables([len(ids)])
    try:  # through a runner, so that under tensor parallelism every rank runs the step
        runner = ModelRunner(model, int(table.max()) + 1, ids.device)
        run.logits = runner.forward(ids.cpu(), step_metadata([0], [len(ids)], table, all_logits=True))
    finally:
        for h in handles:
            h.remove()
    return run


def _topk_agreement(hf_topk: torch.Tensor, ours: torch.Tensor, scores: torch.Tensor | None) -> tuple[float, list[int]]:
    """(recall of HF's causal choices up to exact ties, tokens whose sets differ only by exactly
    tied scores). A tie swap counts as agreement; without our scores no tie is recognised."""
    found = total = 0
    tie_rows = []
    for t in range(ours.shape[0]):
        want = {p for p in hf_topk[t].tolist() if 0 <= p <= t}
        got = {p for p in ours[t].tolist() if p >= 0}
        total += len(want)
        if want != got and got and scores is not None:
            row = scores[t].cpu()
            kth = row[list(got)].min()
            tol = TIE_TOL * row[torch.isfinite(row)].abs().max()
            if all(abs(row[p] - kth) <= tol for p in want ^ got):
                tie_rows.append(t)
                got = want
        found += len(want & got)
    return found / max(total, 1), tie_rows


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item() if a.numel() else 0.0


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return F.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0).item() if a.numel() else 1.0


def compare(hf: Run, ours: Run, mode: str = "reference") -> Report:
    """Compare the runs; in reference mode only the tokens before the first tie swap count."""
    agreement = [_topk_agreement(hf.topk[i].cpu(), ours.topk[i].cpu(), ours.scores.get(i)) if i in hf.topk
                 else (None, []) for i in range(len(hf.hidden))]
    tie_rows = [t for _, rows in agreement for t in rows] if mode == "reference" else []
    rows = min(tie_rows, default=len(hf.logits))
    if tie_rows:
        logger.warning("exact ties in the indexer's top-k from token %d on: comparing tokens [0, %d)", rows, rows)
    layers = [
        LayerReport(_cosine(o[:rows], h[:rows]), _rel_err(o[:rows], h[:rows]), recall, len(ties))
        for h, o, (recall, ties) in zip(hf.hidden, ours.hidden, agreement)
    ]
    greedy = (ours.logits[:rows].argmax(-1) == hf.logits[:rows].argmax(-1)).float().mean().item() if rows else 1.0
    return Report(layers, _cosine(ours.logits[:rows], hf.logits[:rows]), _rel_err(ours.logits[:rows], hf.logits[:rows]),
                  greedy, rows, len(hf.logits))


def format_report(report: Report) -> str:
    lines = [f"{'layer':>5}  {'cosine':>10}  {'max rel err':>11}  {'top-k recall':>12}  {'tie swaps':>9}"]
    for i, r in enumerate(report.layers):
        recall = "-" if r.recall is None else f"{r.recall:.4f}"
        lines.append(f"{i:>5}  {r.cosine:>10.7f}  {r.rel_err:>11.3e}  {recall:>12}  {r.tie_swaps:>9}")
    lines.append(f"logits: cosine {report.logits_cosine:.7f}, max rel err {report.logits_rel_err:.3e}, "
                 f"greedy agreement {report.greedy:.4f} over {report.rows}/{report.tokens} tokens")
    return "\n".join(lines)
