"""``flashdsa serve [--model DIR|REPO]``: an OpenAI-compatible HTTP server over the engine.

The listening socket is bound before the model loads (by rank 0 alone under torchrun), so a port
in use fails at once; the log then says where the server listens and what it serves (model, mode,
device, KV cache size).
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
from pathlib import Path
from typing import Optional

import torch

from flashdsa.arguments import add_model_arguments, add_step_arguments, float_in, int_in
from flashdsa.errors import ArgumentError, blame
from flashdsa.runtime.async_engine import AsyncLLM
from flashdsa.runtime.engine import EngineConfig, LLMEngine
from flashdsa.runtime.parallel.plan_command import add_parallel_arguments, parallel_config
from flashdsa.runtime.sampling_params import generation_defaults
from flashdsa.runtime.sequence import BLOCK_SIZE
from flashdsa.serve.app import ServerState, build_app
from flashdsa.serve.limits import RequestLimits
from flashdsa.serve.metrics import ServerMetrics

logger = logging.getLogger(__name__)
LOG_LEVEL = "INFO"  # the startup line says where the server listens


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
    add_model_arguments(parser)
    parser.add_argument("--served-model-name", help="model id clients send (default: the directory name)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int_in(0, 65535), default=8000, help="port (default 8000; 0: any free port)")
    parser.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on every /v1 route")
    parser.add_argument("--max-num-seqs", type=int_in(1), default=64, help="running sequences at most")
    parser.add_argument("--max-num-batched-tokens", type=int_in(1), default=2048, help="tokens per step at most")
    parser.add_argument("--max-model-len", type=int_in(2),
                        help="prompt + output tokens at most (default and maximum: the model's positions)")
    cache = parser.add_mutually_exclusive_group()
    cache.add_argument("--num-blocks", type=int_in(1), help="cache size in 64-token blocks")
    cache.add_argument("--cache-fraction", type=float_in(0, 1, low_open=True), default=0.9,
                       help="fraction of device memory the process may fill with weights + cache (CUDA)")
    parser.add_argument("--max-queued", type=int_in(0), default=1024,
                        help="sequences that may wait beyond --max-num-seqs; more get a 503")
    parser.add_argument("--no-prefix-caching", action="store_true", help="disable prefix caching")
    # per-request caps (serve/limits.py) and sampling defaults
    parser.add_argument("--max-request-bytes", type=int_in(1), default=RequestLimits.max_request_bytes,
                        help="request bodies above this many bytes get a 413")
    parser.add_argument("--max-n", type=int_in(1), default=RequestLimits.max_n,
                        help="choices (n, best_of) one request may ask for")
    parser.add_argument("--max-stop", type=int_in(1), default=RequestLimits.max_stop,
                        help="stop strings one request may give")
    parser.add_argument("--max-logprob-entries", type=int_in(1),
                        help="logprob entries one request may return (default: 2**20, or one full-length choice "
                             "with 20 alternatives if more)")
    parser.add_argument("--generation-config", default="auto",
                        help="sampling defaults: 'auto' reads the model's generation_config.json, 'none' ignores it, "
                             "or a directory holding one")
    add_parallel_arguments(parser)
    add_step_arguments(parser)
    parser.add_argument("--speculative-tokens", type=int, choices=[0, 1], default=0,
                        help="1: speculative decoding, one token drafted per step by the model's MTP layer")


def listen(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` and listening (IPv6 when ``host`` holds a colon)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family)
    except socket.gaierror as exc:
        raise ArgumentError("--host", f"cannot resolve {host!r} ({exc.strerror})") from None
    except OSError as exc:
        raise ArgumentError("--port", f"cannot listen on {host}:{port} ({exc.strerror}); pick another port") from None


def served_name(model: Optional[str], path: Path) -> str:
    """The model id clients send by default: a directory's name, or the Hub repo id as given."""
    if model is None or Path(model).expanduser().is_dir():
        return path.name
    return model


def sampling_defaults(choice: str, model_dir: Path) -> dict:
    """The sampling defaults ``--generation-config`` asks for: 'auto' (the model's
    generation_config.json, if any), 'none', or a directory holding one."""
    if choice == "none":
        return {}
    source = model_dir if choice == "auto" else Path(choice)
    if not source.is_dir():
        raise ArgumentError("--generation-config", f"{choice}: no such directory; pass auto, none or a directory "
                                                   f"holding a generation_config.json")
    with blame("--generation-config"):  # a file that does not parse or holds values out of range
        return generation_defaults(source)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from flashdsa.models.resolve import open_model, read_checkpoint, resolve_model

    config = EngineConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                          max_model_len=args.max_model_len, num_blocks=args.num_blocks,
                          cache_fraction=args.cache_fraction, enable_prefix_caching=not args.no_prefix_caching,
                          speculative_tokens=args.speculative_tokens, enforce_eager=args.enforce_eager,
                          async_scheduling=args.async_scheduling)
    parallel = parallel_config(args, "serve")
    path = resolve_model(args.model)
    with blame("--max-model-len"):  # checked before the weights load
        config.model_len(read_checkpoint(path).max_position_embeddings)
    defaults = sampling_defaults(args.generation_config, path)
    limits = RequestLimits(args.max_request_bytes, args.max_n, args.max_stop, args.max_logprob_entries)
    # Under torchrun every rank runs this command; only rank 0 serves (the others stay in open_model).
    sock = listen(args.host, args.port) if os.environ.get("RANK", "0") == "0" else None
    model, tokenizer = open_model(path, args.device, args.mode, args.quantization, parallel,
                                  mtp=args.speculative_tokens > 0)
    name = args.served_model_name or served_name(args.model, path)
    app = make_app(model, tokenizer, name, config, args.max_queued, args.api_key, limits, defaults)
    engine = app.state.server.llm.engine
    host, port = sock.getsockname()[:2]
    logger.info("serving %s at http://%s:%d/v1 (model %s, mode %s, device %s, KV cache %d blocks = %d tokens, "
                "%.2f GiB; max model len %d)", name, f"[{host}]" if ":" in host else host, port, path, args.mode,
                engine.device, engine.num_blocks, engine.num_blocks * BLOCK_SIZE,
                engine.num_blocks * model.cache_bytes_per_block() / 2**30, engine.max_model_len)
    uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[sock])
    return 0
