"""``flashdsa serve [--model DIR]``: an OpenAI-compatible HTTP server over the engine."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Optional

import torch

from flashdsa.defaults import DEFAULT_MODEL
from flashdsa.runtime.async_engine import AsyncLLM
from flashdsa.runtime.engine import EngineConfig, LLMEngine
from flashdsa.runtime.parallel.plan_command import add_parallel_arguments, parallel_config
from flashdsa.runtime.sampling_params import generation_defaults
from flashdsa.serve.app import ServerState, build_app
from flashdsa.serve.limits import RequestLimits
from flashdsa.serve.metrics import ServerMetrics

logger = logging.getLogger(__name__)


def make_app(
    model: torch.nn.Module,
    tokenizer,
    model_name: str,
    config: Optional[EngineConfig] = None,
    max_queued: int = 1024,
    api_key: Optional[str] = None,
    limits: Optional[RequestLimits] = None,
    sampling_defaults: Optional[dict] = None,
):
    """The FastAPI app serving ``model``; its engine thread starts with the app (lifespan).
    sampling_defaults: SamplingParams fields requests fall back to (generation_defaults())."""
    engine = LLMEngine(model, tokenizer, config)
    metrics = ServerMetrics(engine)
    llm = AsyncLLM(engine, max_queued=max_queued, on_step=metrics.on_step)
    state = ServerState(llm, tokenizer, model_name, metrics, api_key, limits or RequestLimits(), sampling_defaults or {})
    return build_app(state)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=str(DEFAULT_MODEL),
                        help="checkpoint directory (HF layout; default: the embedded Shakespeare model)")
    parser.add_argument("--served-model-name", help="model id clients send (default: the directory name)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu or cuda")
    parser.add_argument("--mode", default="production", choices=["reference", "production"],
                        help="precision mode of the model (default production: FP8 caches)")
    parser.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on every /v1 route")
    parser.add_argument("--max-num-seqs", type=int, default=64, help="running sequences at most")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048, help="tokens per step at most")
    parser.add_argument("--max-model-len", type=int, help="prompt + output tokens at most")
    cache = parser.add_mutually_exclusive_group()
    cache.add_argument("--num-blocks", type=int, help="cache size in 64-token blocks")
    cache.add_argument("--cache-fraction", type=float, default=0.9,
                       help="fraction of device memory the process may fill with weights + cache (CUDA)")
    parser.add_argument("--max-queued", type=int, default=1024,
                        help="sequences that may wait beyond --max-num-seqs; more get a 503")
    parser.add_argument("--no-prefix-caching", action="store_true", help="disable prefix caching")
    # per-request caps (serve/limits.py) and sampling defaults
    parser.add_argument("--max-request-bytes", type=int, default=RequestLimits.max_request_bytes,
                        help="request bodies above this many bytes get a 413")
    parser.add_argument("--max-n", type=int, default=RequestLimits.max_n, help="choices (n, best_of) one request may ask for")
    parser.add_argument("--max-stop", type=int, default=RequestLimits.max_stop, help="stop strings one request may give")
    parser.add_argument("--max-logprob-entries", type=int,
                        help="logprob entries one request may return (default: 2**20, or one full-length choice "
                             "with 20 alternatives if more)")
    parser.add_argument("--generation-config", default="auto",
                        help="sampling defaults: 'auto' reads the model's generation_config.json, 'none' ignores it, "
                             "or a directory holding one")
    add_parallel_arguments(parser)
    parser.add_argument("--speculative-tokens", type=int, choices=[0, 1], default=0,
                        help="1: speculative decoding, one token drafted per step by the model's MTP layer")


def run(args: argparse.Namespace) -> int:
    import uvicorn
    from transformers import AutoTokenizer

    from flashdsa.runtime.parallel.launcher import load

    parallel = parallel_config(args, "serve")
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    try:
        model = load(args.model, parallel, args.device, args.mode, mtp=args.speculative_tokens > 0)
    except ValueError as exc:
        raise SystemExit(f"flashdsa serve: {exc}")
    config = EngineConfig(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        num_blocks=args.num_blocks,
        cache_fraction=args.cache_fraction,
        enable_prefix_caching=not args.no_prefix_caching,
        speculative_tokens=args.speculative_tokens,
    )
    name = args.served_model_name or Path(args.model).name
    limits = RequestLimits(args.max_request_bytes, args.max_n, args.max_stop, args.max_logprob_entries)
    source = {"auto": args.model, "none": None}.get(args.generation_config, args.generation_config)
    defaults = generation_defaults(source) if source is not None else {}
    app = make_app(model, tokenizer, name, config, args.max_queued, args.api_key, limits, defaults)
    logger.info("serving %s on http://%s:%d", name, args.host, args.port)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0
