"""Speculative decoding with the MTP layer on the GPU, CUDA graphs on both sides.

- ``--model DIR`` (a checkpoint with an MTP layer: the retrained default model): batch-1 decode
  tokens/s from held-out Shakespeare prompts with and without ``speculative_tokens=1``, greedy
  and sampled at generate's temperature and top-k (0.8, 40) without a seed, as a server request
  comes, and the acceptance rate. The headline compares both with async scheduling (the default on
  CUDA; greedy and unseeded sampled speculative steps overlap, seeded ones would run
  synchronously); the synchronous pair is in the note.
  Target: >= 1.4x the tokens/s without speculation.
- The V3.2-width random model (``--layers`` layers, FP8, plus a random MTP layer, so nearly every
  draft is rejected): the cost of a speculative decode step (the main model at s_q = 2 plus the
  MTP layer) against a plain one (s_q = 1) at batch 1, 32 and 128.

  python benchmarks/bench_mtp.py --model DIR [--data tinyshakespeare.txt] [--output BENCHMARKS.md]
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import output_parser, report, Row  # noqa: E402
from flashdsa.models.loader import load_model  # noqa: E402
from flashdsa.models.synthetic import v32_config, write_random_checkpoint  # noqa: E402
from flashdsa.runtime.engine import EngineConfig, LLMEngine  # noqa: E402
from flashdsa.runtime.sampling_params import SamplingParams  # noqa: E402

SAMPLINGS = {"greedy": dict(temperature=0.0), "T 0.8 top-k 40": dict(temperature=0.8, top_k=40)}
STEP_BATCHES, STEP_CONTEXT = (1, 32, 128), 2048


def engine_for(model, tokenizer, batch: int, max_len: int, speculative: int, overlap: bool = False) -> LLMEngine:
    """An engine for the benchmark; ``overlap``: async scheduling."""
    config = EngineConfig(max_num_seqs=batch, max_num_batched_tokens=16384, max_model_len=max_len,
                          num_blocks=batch * -(-max_len // 64) + 8, enable_prefix_caching=False,
                          speculative_tokens=speculative, async_scheduling=overlap)
    return LLMEngine(model, tokenizer, config)


def held_out_prompts(tokenizer, data: Path, count: int, length: int) -> list[list[int]]:
    """``count`` windows of ``length`` tokens from the held-out last 10% of the corpus."""
    text = data.read_text(encoding="utf-8")
    ids = tokenizer(text[int(0.9 * len(text)) :])["input_ids"]
    stride = (len(ids) - length) // count
    return [ids[i * stride : i * stride + length] for i in range(count)]


def decode_rate(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> float:
    """Tokens/s after each request's first token, one request at a time (batch 1)."""
    tokens, seconds = 0, 0.0
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
        engine.step()  # prefill and the first token
        torch.cuda.synchronize()
        start, produced = time.perf_counter(), 0
        while engine.has_unfinished():
            produced += sum(len(o.new_token_ids) for o in engine.step())
        seconds += time.perf_counter() - start
        tokens += produced
    return tokens / seconds


def default_model_rows(path: Path, data: Path, prompts: int, tokens: int) -> list[Row]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = load_model(path, device="cuda", mtp=True)
    windows = held_out_prompts(tokenizer, data, prompts, 64)
    rows = []
    for name, sampling in SAMPLINGS.items():
        params = SamplingParams(max_tokens=tokens, ignore_eos=True, **sampling)
        rates = {}
        for spec, overlap in ((0, True), (1, True), (0, False), (1, False)):
            engine = engine_for(model, tokenizer, 1, 64 + tokens + 1, spec, overlap)
            decode_rate(engine, windows[:1], params)  # warm-up
            drafts, accepts = engine.num_draft_tokens, engine.num_accepted_tokens
            rates[spec, overlap] = decode_rate(engine, windows, params)
            if spec:
                accepted = (engine.num_accepted_tokens - accepts) / max(engine.num_draft_tokens - drafts, 1)
        with_mtp, plain = rates[1, True], rates[0, True]
        rows.append(Row("decode b=1, MTP speculation, async scheduling", f"default model, {name}", 1e3 / with_mtp,
                        with_mtp / plain, "x", 1.4,
                        f"{with_mtp:.0f} vs {plain:.0f} tok/s (both async-scheduled); synchronous: "
                        f"{rates[1, False]:.0f} vs {rates[0, False]:.0f} tok/s "
                        f"({rates[1, False] / rates[0, False]:.2f}x); acceptance {accepted:.1%} over {prompts} "
                        f"held-out prompts x {tokens} tokens"))
        print(rows[-1], flush=True)
    return rows


def step_ms(engine: LLMEngine, model, batch: int, steps: int) -> float:
    """Median ms of a decode step of ``batch`` sequences at STEP_CONTEXT tokens of context."""
    gen = torch.Generator().manual_seed(batch)
    params = SamplingParams(max_tokens=2 * steps + 16, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        prompt = torch.randint(3, model.config.vocab_size, (STEP_CONTEXT,), generator=gen).tolist()
        engine.add_request(f"{batch}-{i}", prompt, params)
    started = set()
    while len(started) < batch:  # prefill, and the first decode step that drafts
        started |= {o.request_id for o in engine.step()}
    engine.step()
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        engine.step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    for i in range(batch):
        engine.abort(f"{batch}-{i}")
    return statistics.median(times) * 1e3


def step_cost_rows(layers: int, steps: int) -> list[Row]:
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        write_random_checkpoint(tmp, v32_config(layers), device="cuda", mtp=True)
        model = load_model(tmp, device="cuda", mtp=True)
        tokenizer = AutoTokenizer.from_pretrained(tmp)
    max_len = STEP_CONTEXT + 2 * steps + 32
    engines = {spec: engine_for(model, tokenizer, max(STEP_BATCHES), max_len, spec) for spec in (0, 1)}
    rows = []
    for batch in STEP_BATCHES:
        ms = {spec: step_ms(engine, model, batch, steps) for spec, engine in engines.items()}
        rows.append(Row("decode step, s_q=2 + MTP layer vs s_q=1", f"V3.2 width, {layers} layers, b={batch} "
                        f"ctx={STEP_CONTEXT}", ms[1], ms[1] / ms[0], "x", 1.0,
                        f"{ms[1]:.2f} vs {ms[0]:.2f} ms/step (CUDA graphs both); break-even acceptance "
                        f"{ms[1] / ms[0] - 1:.0%}"))
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = output_parser(__doc__)
    parser.add_argument("--model", type=Path, help="checkpoint with an MTP layer (the retrained default model)")
    parser.add_argument("--data", type=Path, default=Path(__file__).resolve().parents[2] / "shared/data/tinyshakespeare.txt")
    parser.add_argument("--prompts", type=int, default=8, help="held-out prompts timed per setting")
    parser.add_argument("--tokens", type=int, default=256, help="tokens generated per prompt")
    parser.add_argument("--layers", type=int, default=4, help="layers of the V3.2-width model (0: skip it)")
    parser.add_argument("--steps", type=int, default=20, help="decode steps timed per batch size")
    args = parser.parse_args()
    rows = default_model_rows(args.model, args.data, args.prompts, args.tokens) if args.model else []
    if args.layers:
        rows += step_cost_rows(args.layers, args.steps)
    report("Speculative decoding with the MTP layer (CUDA graphs on both sides)", rows, args.output)


if __name__ == "__main__":
    main()
