"""Train flashdsa's embedded default model: a ~7M-parameter DeepSeek-V3.2 (DSA) model on Tiny Shakespeare.

    python scripts/train_default_model.py --output flashdsa/assets/default_model

Recipe (one GPU, at most about six minutes of training; under eight in all with the measurements):
  0. a byte-level BPE tokenizer (2048 tokens) trained on the corpus (or --tokenizer DIR reused);
  1. ``dense``: from random weights, language modelling with dense attention (indexer frozen),
     plus the multi-token-prediction (MTP) layer's loss at weight 0.3 (DeepSeek-V3's first value);
  2. ``warmup``: the indexers alone learn the dense attention (KL over all causal keys);
  3. ``sparse``: top-k attention (topk 64 of up to 512 keys) through the sparse kernels' autograd,
     LM loss plus the MTP loss at weight 0.1 plus the indexer KL over the selected keys;
  4. ``mtp`` (only with ``--mtp-distill``: the shipped model was trained by stages 0-3): the main model frozen (its outputs stay bit for bit), the MTP layer alone learns the
     main model's next-token distribution (self-distillation: KL(main at i+1 || MTP at i), sparse
     attention as at inference, its indexer by its KL), since speculative decoding accepts a draft
     when it is the main model's own choice, not the data's; about 1.5 minutes on an H100.
The last 10% of the corpus is held out. Each stage keeps the weights of its best held-out loss,
the ``mtp`` stage those of its best held-out top-1 agreement with the main model (the greedy
acceptance rate on the held-out text).
The result (bf16 weights, HF layout, with the MTP layer) goes to --output with ``training.json``
(losses, timings, the speculative-decoding acceptance rate on held-out prompts, a sample
generated through the production inference path) and the stages' log and loss plot.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

from flashdsa.models.config import DeepseekV32Config
from flashdsa.models.deepseek_v32 import DeepseekV32ForCausalLM
from flashdsa.models.mtp import add_mtp_layer
from flashdsa.train.autograd import sparse_mla_attention
from flashdsa.train.checkpoint import save_model
from flashdsa.train.data import eval_batches, read_documents, split_stream, token_stream
from flashdsa.train.init import initialize
from flashdsa.train.loop import LOG_FILE, TrainConfig, Trainer, evaluate
from flashdsa.train.plot import save_loss_png
from flashdsa.train.safe_io import read_records
from flashdsa.train.tokenizer import train_bpe_tokenizer

logger = logging.getLogger("train_default_model")

CONFIG = dict(
    vocab_size=2048, hidden_size=256, intermediate_size=768, moe_intermediate_size=256, num_hidden_layers=4,
    num_attention_heads=4, q_lora_rank=128, kv_lora_rank=512, qk_nope_head_dim=64, qk_rope_head_dim=64,
    v_head_dim=64, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1,
    routed_scaling_factor=1.0, first_k_dense_replace=2, index_n_heads=8, index_head_dim=128, index_topk=64,
    max_position_embeddings=1024, rope_theta=10000.0, bos_token_id=0, eos_token_id=1,
)
COMMON = dict(seq_len=512, batch_tokens=8192, eval_every=25, eval_tokens=65536, keep_best=True)
STAGES = [  # (name, steps, peak lr, seconds allowed, TrainConfig settings)
    ("dense", 1000, 1e-3, 130, dict(stage="dense", mtp_loss_weight=0.3)),  # held-out loss is lowest near step
    # 500, then it overfits; the best is kept
    ("warmup", 200, 1e-3, 30, dict(stage="warmup", mtp_loss_weight=0.3)),  # (the MTP layer's indexer learns its KL)
    ("sparse", 400, 3e-4, 100, dict(stage="sparse", mtp_loss_weight=0.1)),  # (a 500 / 200 / 200-step variant
    # ended worse: 3.964 vs 3.946 eval loss)
    ("mtp", 1000, 1e-3, 90, dict(stage="sparse", mtp_only=True, mtp_loss_weight=0.0, mtp_distill_weight=1.0,
                                 keep_best_by="mtp_agreement")),  # not yet run on a GPU
]
PLOTTED = {"warmup": "eval_indexer_kl", "mtp": "eval_mtp_distill"}  # the others: eval_lm_loss
ACCEPTANCE_PROMPTS, ACCEPTANCE_PROMPT_TOKENS, ACCEPTANCE_OUTPUT_TOKENS = 32, 64, 128
SAMPLE_PROMPT = "ROMEO:\n"
ALL_STAGES_LOG = "all_stages.jsonl"


def sparse_backend(device: torch.device, wanted: str) -> str:
    """The sparse-attention backend to train with: ``wanted``, or for "auto" the Triton kernels when
    their gradients match the reference on a small problem, else the reference."""
    if wanted != "auto":
        return wanted
    if device.type != "cuda":
        return "reference"
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(256, 4, 576, device=device, generator=g).bfloat16().requires_grad_()
    kv = torch.randn(256, 1, 576, device=device, generator=g).bfloat16().requires_grad_()
    causal = torch.arange(256, device=device)[:, None] - torch.arange(64, device=device)[None, :]
    indices = causal.clamp_min(-1).to(torch.int32)[:, None, :]
    dout = torch.randn(256, 4, 512, device=device, generator=g).bfloat16()
    grads = {}
    try:
        for backend in ("triton", "reference"):
            out, _ = sparse_mla_attention(q, kv, indices, 576**-0.5, 512, backend)
            grads[backend] = torch.autograd.grad((out.float() * dout.float()).sum(), (q, kv))
    except Exception as e:  # a kernel that fails to build or run: train on the reference instead
        logger.error("triton sparse attention failed (%s: %s); training with the reference", type(e).__name__, e)
        return "reference"
    for a, b in zip(grads["triton"], grads["reference"]):
        cosine = torch.nn.functional.cosine_similarity(a.float().flatten(), b.float().flatten(), dim=0)
        if not cosine > 0.999:
            logger.error("triton gradients differ from the reference (cosine %.6f); using the reference", cosine)
            return "reference"
    return "triton"


def held_out_losses(model_dir: Path, eval_tokens: torch.Tensor, seq_len: int, device: torch.device) -> dict:
    """Held-out LM loss of the exported (bf16) model with sparse and with dense attention, the indexer
    KL, and the MTP layer's loss, KL to the main model and top-1 agreement with it (sparse)."""
    from flashdsa.models.loader import load_model

    model = load_model(model_dir, device=device, mode="reference", mtp=True)
    batches = eval_batches(eval_tokens, seq_len, 16, len(eval_tokens))
    sparse = evaluate(model, batches, TrainConfig(stage="sparse", steps=1, seq_len=seq_len), device)
    dense = evaluate(model, batches, TrainConfig(stage="dense", steps=1, seq_len=seq_len), device)
    return {"sparse_lm_loss": sparse["eval_lm_loss"], "indexer_kl": sparse["eval_indexer_kl"],
            "mtp_loss": sparse["eval_mtp_loss"], "mtp_distill": sparse["eval_mtp_distill"],
            "mtp_agreement": sparse["eval_mtp_agreement"], "dense_lm_loss": dense["eval_lm_loss"],
            "tokens": sum(b[:, 1:].numel() for b in batches)}


def acceptance_rates(model_dir: Path, eval_tokens: torch.Tensor, device: torch.device, smoke: bool) -> dict:
    """Speculative decoding (--speculative-tokens 1) from held-out prompts through the engine:
    the share of MTP drafts the model accepts, greedy and at generate's default sampling."""
    from flashdsa.models.loader import load_model
    from flashdsa.runtime.llm import LLM
    from flashdsa.runtime.sampling_params import SamplingParams

    n, length, new = (4, 16, 16) if smoke else (ACCEPTANCE_PROMPTS, ACCEPTANCE_PROMPT_TOKENS, ACCEPTANCE_OUTPUT_TOKENS)
    stride = (len(eval_tokens) - length) // n
    prompts = [eval_tokens[i * stride : i * stride + length].tolist() for i in range(n)]
    mode = "production" if device.type == "cuda" else "reference"
    model = load_model(model_dir, device=device, mode=mode, mtp=True)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rates = {"prompts": n, "prompt_tokens": length, "output_tokens": new}
    for name, params in (("greedy", SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)),
                         ("temperature_0.8_top_k_40", SamplingParams(temperature=0.8, top_k=40, seed=0,
                                                                     max_tokens=new, ignore_eos=True))):
        llm = LLM(model, tokenizer, speculative_tokens=1, max_num_seqs=n, max_model_len=length + new + 1)
        llm.generate(prompts, params, use_tqdm=False)
        engine = llm.engine
        rates[name] = engine.num_accepted_tokens / max(engine.num_draft_tokens, 1)
        del llm, engine
    return rates


def sample(model_dir: Path, device: torch.device, max_tokens: int = 200) -> str:
    """Text generated from SAMPLE_PROMPT by the inference path (production mode on CUDA: FP8 caches)."""
    from flashdsa.generate import single_request_engine, stream_request
    from flashdsa.models.loader import load_model
    from flashdsa.runtime.sampling_params import SamplingParams

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    mode = "production" if device.type == "cuda" else "reference"
    model = load_model(model_dir, device=device, mode=mode)
    prompt = tokenizer(SAMPLE_PROMPT)["input_ids"]
    engine = single_request_engine(model, tokenizer, len(prompt) + max_tokens)
    pieces: list[str] = []
    params = SamplingParams(temperature=0.8, top_k=40, seed=0, max_tokens=max_tokens)
    stream_request(engine, prompt, params, pieces.append)
    return SAMPLE_PROMPT + "".join(pieces)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=str(Path(__file__).resolve().parents[2] / "shared/data/tinyshakespeare.txt"))
    parser.add_argument("--output", required=True, help="where the trained model goes")
    parser.add_argument("--work", default="runs/default_model", help="stage checkpoints and logs")
    parser.add_argument("--tokenizer", default=None, help="reuse the tokenizer files in this directory")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--backend", default="auto", choices=["auto", "triton", "reference"])
    parser.add_argument("--time-scale", type=float, default=1.0, help="multiply every stage's steps and time")
    parser.add_argument("--smoke", action="store_true", help="short sequences, tiny batches: check the script on CPU")
    parser.add_argument("--mtp-distill", action="store_true",
                        help="add the mtp stage (the shipped model was trained without it; not yet run on a GPU)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    device, work, output = torch.device(args.device), Path(args.work), Path(args.output)
    common = dict(COMMON, seq_len=128, batch_tokens=256, eval_tokens=512) if args.smoke else COMMON
    work.mkdir(parents=True, exist_ok=True)
    (work / ALL_STAGES_LOG).unlink(missing_ok=True)
    torch.manual_seed(0)

    tokenizer_dir = Path(args.tokenizer) if args.tokenizer else work / "tokenizer"
    if not args.tokenizer:
        train_bpe_tokenizer([Path(args.data).read_text(encoding="utf-8")], CONFIG["vocab_size"], tokenizer_dir)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokens = token_stream(read_documents(args.data, tokenizer), tokenizer)
    train_tokens, eval_tokens = split_stream(tokens, 0.1, common["seq_len"])
    logger.info("corpus: %d tokens (%d train, %d held out)", len(tokens), len(train_tokens), len(eval_tokens))

    model = initialize(DeepseekV32ForCausalLM(DeepseekV32Config(**CONFIG), mode="reference"), seed=0)
    initialize(add_mtp_layer(model), seed=1, depth=CONFIG["num_hidden_layers"])
    model = model.to(device)
    backend = sparse_backend(device, args.backend)
    logger.info("model: %.2fM parameters; sparse attention backend: %s",
                sum(p.numel() for p in model.parameters()) / 1e6, backend)
    summary = {"config": CONFIG, "backend": backend, "device": torch.cuda.get_device_name() if device.type == "cuda"
               else "cpu", "train_tokens": len(train_tokens), "eval_tokens": len(eval_tokens), "stages": []}
    series, offset = [], 0
    for name, steps, lr, seconds, settings in [s for s in STAGES if args.mtp_distill or s[0] != "mtp"]:
        cfg = TrainConfig(steps=max(1, int(steps * args.time_scale)), lr=lr, backend=backend,
                          time_limit_s=seconds * args.time_scale, **settings, **common)
        shutil.rmtree(work / name, ignore_errors=True)
        trainer = Trainer(model, train_tokens, eval_tokens, cfg, work / name, tokenizer_dir, device)
        started = time.perf_counter()
        metrics = trainer.train()
        records = read_records(work / name / LOG_FILE)
        speed = sorted(r["tokens_per_s"] for r in records)[len(records) // 2]
        summary["stages"].append({"stage": name, "steps": trainer.step, "lr": lr, "median_tokens_per_s": speed,
                                  "seconds": time.perf_counter() - started, **metrics})
        logger.info("%s: %s", name, summary["stages"][-1])
        key = PLOTTED.get(name, "eval_lm_loss")
        points = [(offset + r["step"], r[key]) for r in records if key in r]
        series.append((f"{name} {key[5:]}", points))
        offset += trainer.step
        with (work / ALL_STAGES_LOG).open("a") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)

    save_model(model, output, tokenizer_dir, dtype=torch.bfloat16, max_shard_bytes=15 << 20)
    save_loss_png(work / "loss.png", series)
    summary["held_out"] = held_out_losses(output, eval_tokens, common["seq_len"], device)
    summary["acceptance"] = acceptance_rates(output, eval_tokens, device, args.smoke)
    logger.info("speculative decoding acceptance on held-out prompts: %s", summary["acceptance"])
    try:
        summary["sample"] = sample(output, device)
    except Exception as e:  # the sample documents the model; a failure must not lose the training
        logger.exception("sampling failed")
        summary["sample_error"] = f"{type(e).__name__}: {e}"
    (work / "training.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
