"""``flashdsa generate``: one prompt, prefill then decode through the paged caches, streamed.

The sampler here is deliberately minimal (temperature, top-k, top-p on one row); the serving
engine has its own batched sampler in ``flashdsa.runtime.sampling``.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from flashdsa.models.batch import contiguous_block_tables, step_metadata
from flashdsa.models.caches import MODES
from flashdsa.models.deepseek_v32 import DeepseekV32ForCausalLM


def sample(
    logits: torch.Tensor, temperature: float, top_p: float, top_k: int, generator: torch.Generator | None
) -> int:
    """Next token from ``logits: [vocab]`` fp32; temperature 0 is greedy (argmax)."""
    if temperature <= 0:
        return int(logits.argmax())
    logits = logits / temperature
    if 0 < top_k < logits.numel():
        logits = logits.masked_fill(logits < logits.topk(top_k).values[-1], float("-inf"))
    probs = logits.softmax(-1)
    if top_p < 1:
        sorted_probs, order = probs.sort(descending=True)
        outside = sorted_probs.cumsum(0) - sorted_probs >= top_p  # tokens after the nucleus is full
        probs = probs.scatter(0, order, sorted_probs.masked_fill(outside, 0))
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))


def generate_ids(
    model: DeepseekV32ForCausalLM,
    prompt: list[int],
    max_tokens: int,
    pick: Callable[[torch.Tensor], int],
    stop: set[int] = frozenset(),
    on_token: Callable[[int], None] | None = None,
) -> tuple[list[int], float, float]:
    """Prefill ``prompt``, then decode up to ``max_tokens`` tokens (stopping after a ``stop`` id).

    Returns (generated ids, prefill seconds, decode seconds)."""
    device = model.device
    table = contiguous_block_tables([len(prompt) + max_tokens])
    caches = model.allocate_caches(int(table.max()) + 1)
    out: list[int] = []
    start = time.perf_counter()
    logits = model(torch.tensor(prompt, device=device), step_metadata([0], [len(prompt)], table, device=device), caches)
    prefill_end = time.perf_counter()
    while len(out) < max_tokens:
        token = pick(logits[0].float())
        out.append(token)
        if on_token:
            on_token(token)
        if token in stop or len(out) == max_tokens:
            break
        meta = step_metadata([len(prompt) + len(out) - 1], [1], table, device=device)
        logits = model(torch.tensor([token], device=device), meta, caches)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return out, prefill_end - start, time.perf_counter() - prefill_end


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, type=Path, help="checkpoint directory (HF layout)")
    parser.add_argument("--prompt", required=True, help="prompt text")
    parser.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most (default 64)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default 0)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1: off)")
    parser.add_argument("--top-k", type=int, default=0, help="sample among the k best tokens (default 0: off)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="torch device")
    parser.add_argument("--mode", choices=MODES, default="production", help="precision mode (default production)")


def encode_prompt(tokenizer, text: str, chat: bool) -> list[int]:
    if not chat:
        return tokenizer(text).input_ids
    messages = [{"role": "user", "content": text}]
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(rendered, add_special_tokens=False).input_ids


class TextStream:
    """Print the decoded text of a growing id list as it grows; trailing U+FFFD (a UTF-8
    character split across tokens) waits for the next token or :meth:`finish`."""

    def __init__(self, tokenizer):
        self.tokenizer, self.ids, self.shown = tokenizer, [], 0

    def __call__(self, token: int) -> None:
        self.ids.append(token)
        self._show(self.tokenizer.decode(self.ids, skip_special_tokens=True).rstrip("\ufffd"))

    def finish(self) -> None:
        self._show(self.tokenizer.decode(self.ids, skip_special_tokens=True))

    def _show(self, text: str) -> None:
        if len(text) > self.shown:
            sys.stdout.write(text[self.shown :])
            sys.stdout.flush()
            self.shown = len(text)


def run(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    from flashdsa.models.loader import load_model

    if args.max_tokens < 1:
        raise SystemExit("--max-tokens must be at least 1")
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = load_model(args.model, args.device, args.mode)
    prompt = encode_prompt(tokenizer, args.prompt, args.chat)
    generator = torch.Generator().manual_seed(args.seed)
    eos = model.config.eos_token_id
    stop = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    stream = TextStream(tokenizer)
    ids, prefill_s, decode_s = generate_ids(
        model, prompt, args.max_tokens, lambda row: sample(row, args.temperature, args.top_p, args.top_k, generator),
        stop, stream,
    )
    stream.finish()
    decode_tps = (len(ids) - 1) / decode_s if len(ids) > 1 and decode_s > 0 else float("nan")
    print(f"\n[prompt {len(prompt)} tokens, {len(prompt) / prefill_s:.1f} tok/s | "
          f"generated {len(ids)} tokens, {decode_tps:.1f} tok/s]")
    return 0
