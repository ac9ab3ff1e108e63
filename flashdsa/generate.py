"""``flashdsa generate``: one prompt through the serving engine, its text streamed to stdout.

The request runs exactly as a served one does (scheduler, paged caches, batched sampler,
incremental detokenizer), with a cache sized for this one request. Sampling defaults to
temperature 0.8 among the 40 best tokens with seed 0 (reproducible): greedy decoding of the
small default model loops on one phrase; ``--temperature 0`` gives greedy.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from typing import Optional

import torch

from flashdsa.arguments import add_model_arguments, add_step_arguments, float_in, int_in
from flashdsa.errors import ArgumentError, blame
from flashdsa.runtime.engine import EngineConfig, LLMEngine
from flashdsa.runtime.llm import render_chat
from flashdsa.runtime.parallel.plan_command import add_parallel_arguments, parallel_config
from flashdsa.runtime.sampling_params import SamplingParams
from flashdsa.runtime.sequence import BLOCK_SIZE

DEFAULT_PROMPT = "ROMEO:"  # the default model is trained on Tiny Shakespeare


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    parser.add_argument("--prompt", default=DEFAULT_PROMPT, help=f"prompt text (default {DEFAULT_PROMPT!r})")
    parser.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    parser.add_argument("--max-tokens", type=int_in(1), default=64, help="tokens to generate at most (default 64)")
    parser.add_argument("--temperature", type=float_in(0), default=0.8, help="0 = greedy (default 0.8)")
    parser.add_argument("--top-p", type=float_in(0, 1, low_open=True), default=1.0,
                        help="nucleus sampling mass (default 1: off)")
    parser.add_argument("--top-k", type=int_in(0, 2**31 - 1), default=40,
                        help="sample among the k best tokens (default 40; 0: off)")
    parser.add_argument("--seed", type=int_in(0, 2**63 - 1), default=0, help="sampling seed (default 0)")
    add_parallel_arguments(parser)
    add_step_arguments(parser)
    parser.add_argument("--speculative-tokens", type=int, choices=[0, 1], default=0,
                        help="1: draft a token per step with the model's MTP layer, verified by the model (default 0)")
    parser.add_argument("--verbose", action="store_true", help="also print the speculative acceptance rate")


def encode_prompt(tokenizer, text: str, chat: bool) -> list[int]:
    """The prompt's token ids; with ``chat``, as one user message through the chat template."""
    return render_chat(tokenizer, [{"role": "user", "content": text}])[1] if chat else tokenizer(text).input_ids


def single_request_engine(model: torch.nn.Module, tokenizer, max_len: int, speculative_tokens: int = 0,
                          enforce_eager: bool = False, async_scheduling: Optional[bool] = None) -> LLMEngine:
    """An engine whose cache holds one sequence of ``max_len`` tokens (capped at the model's
    positions), rather than the serving default of as many blocks as memory allows."""
    max_len = min(max_len, model.config.max_position_embeddings)
    config = EngineConfig(max_num_seqs=1, max_model_len=max_len, num_blocks=-(-max_len // BLOCK_SIZE),
                          enable_prefix_caching=False, speculative_tokens=speculative_tokens,
                          enforce_eager=enforce_eager, async_scheduling=async_scheduling)
    return LLMEngine(model, tokenizer, config)


def stream_request(
    engine: LLMEngine, prompt: list[int], params: SamplingParams, write: Callable[[str], None]
) -> tuple[list[int], float, float]:
    """Run one request to its end, passing each step's new text to ``write`` as it comes.

    Returns (output ids, seconds to the first token, seconds after it). ValueError if the
    request does not fit the engine; RuntimeError if it fails."""
    start = time.perf_counter()
    engine.add_request("generate", prompt, params)
    ids: list[int] = []
    first_token_at = None
    while engine.has_unfinished():
        for out in engine.step():
            if out.error is not None:
                raise RuntimeError(out.error)
            if first_token_at is None and out.new_token_ids:
                first_token_at = time.perf_counter()  # the step synchronised when it read the token
            ids += out.new_token_ids
            if out.new_text:
                write(out.new_text)
    end = time.perf_counter()
    return ids, first_token_at - start, end - first_token_at


def timings_line(prompt_tokens: int, prefill_s: float, output_tokens: int, decode_s: float) -> str:
    """Prefill rate over the time to first token; decode rate over the tokens after the first."""
    decode_tps = (output_tokens - 1) / decode_s if output_tokens > 1 and decode_s > 0 else float("nan")
    return (f"[prompt {prompt_tokens} tokens, {prompt_tokens / prefill_s:.1f} tok/s | "
            f"generated {output_tokens} tokens, {decode_tps:.1f} tok/s]")


def acceptance_line(engine: LLMEngine) -> str:
    """Drafts verified and accepted by speculative decoding (``--verbose``)."""
    drafts, accepted = engine.num_draft_tokens, engine.num_accepted_tokens
    rate = f"{accepted / drafts:.1%}" if drafts else "n/a"
    return f"[speculative decoding: {drafts} draft tokens, {accepted} accepted, acceptance rate {rate}]"


def run(args: argparse.Namespace) -> int:
    from flashdsa.models.resolve import open_model

    parallel = parallel_config(args, "generate")
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            seed=args.seed, max_tokens=args.max_tokens)
    model, tokenizer = open_model(args.model, args.device, args.mode, args.quantization, parallel,
                                  mtp=args.speculative_tokens > 0)
    with blame("--chat", (Exception,)):  # a chat template that is missing or fails to render
        prompt = encode_prompt(tokenizer, args.prompt, args.chat)
    positions = model.config.max_position_embeddings
    if not 0 < len(prompt) < positions:
        raise ArgumentError("--prompt", f"has {len(prompt)} tokens; the model takes 1 to {positions - 1} "
                                        f"(and {positions} with the output)")
    engine = single_request_engine(model, tokenizer, len(prompt) + args.max_tokens, args.speculative_tokens,
                                   args.enforce_eager, args.async_scheduling)

    def write(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    with blame("--max-tokens", (ValueError,)):  # prompt + output do not fit the model's positions
        ids, prefill_s, decode_s = stream_request(engine, prompt, params, write)
    print("\n" + timings_line(len(prompt), prefill_s, len(ids), decode_s))
    if args.verbose:
        print(acceptance_line(engine))
    return 0
