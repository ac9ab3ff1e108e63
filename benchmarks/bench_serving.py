"""Serving benchmark: output tokens/s, time to first token and inter-token latency percentiles
at several concurrency levels, against a running OpenAI-compatible server.

Each level sends ``--requests`` (default 2 x concurrency, at least 8) streaming completions of
``--input-len`` random token ids and exactly ``--output-len`` output tokens (ignore_eos), keeping
``concurrency`` in flight. TTFT is the time to the first streamed token, ITL the gaps between
the later ones (the server streams one event per token).

  python benchmarks/bench_serving.py --url http://127.0.0.1:8000          # a running server
  python benchmarks/bench_serving.py --model DIR --device cuda             # starts flashdsa serve
  python benchmarks/bench_serving.py --tiny                                # tiny checkpoint, CPU
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import random
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import commit  # noqa: E402

START_TIMEOUT_S = 300


@dataclass
class RequestTiming:
    ttft: float = 0.0
    itls: list[float] = field(default_factory=list)
    e2e: float = 0.0
    output_tokens: int = 0


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


async def one_request(client: httpx.AsyncClient, model: str, prompt: list[int], output_len: int) -> RequestTiming:
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "ignore_eos": True, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    timing, start = RequestTiming(), time.perf_counter()
    last = None
    async with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(event["error"]["message"])
            if event.get("usage"):
                timing.output_tokens = event["usage"]["completion_tokens"]
            if not event["choices"]:
                continue
            now = time.perf_counter()
            if last is None:
                timing.ttft = now - start
            else:
                timing.itls.append(now - last)
            last = now
    timing.e2e = time.perf_counter() - start
    return timing


WORDS = ("the sea is wide and deep while rain falls on old roofs of a quiet town where lamps come on one "
         "by one and a small model learns to count numbers such as seven forty two and sixty five").split()


def random_prompts(url: str, count: int, length: int, seed: int) -> list[list[int]]:
    """count prompts of exactly length token ids: shuffled words, tokenized by the server."""
    rng, prompts = random.Random(seed), []
    for _ in range(count):
        ids: list[int] = []
        while len(ids) < length:
            text = " ".join(rng.choice(WORDS) for _ in range(length))
            ids += httpx.post(url + "/tokenize", json={"prompt": text}, timeout=30).json()["tokens"]
        prompts.append(ids[:length])
    return prompts


async def run_level(url: str, model: str, concurrency: int, prompts: list[list[int]], output_len: int) -> dict:
    requests = len(prompts)
    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=url, timeout=None, limits=limits) as client:
        async def guarded(prompt):
            async with gate:
                return await one_request(client, model, prompt, output_len)

        start = time.perf_counter()
        timings = await asyncio.gather(*(guarded(p) for p in prompts))
        duration = time.perf_counter() - start
    ttfts = [t.ttft for t in timings]
    itls = [x for t in timings for x in t.itls]
    tokens = sum(t.output_tokens for t in timings)
    return {"concurrency": concurrency, "requests": requests, "duration_s": duration, "output_tok_s": tokens / duration,
            **{f"ttft_p{q}_ms": 1e3 * percentile(ttfts, q) for q in (50, 90, 99)},
            **{f"itl_p{q}_ms": 1e3 * percentile(itls, q) for q in (50, 90, 99)},
            "e2e_p50_s": percentile([t.e2e for t in timings], 50)}


def table(rows: list[dict]) -> str:
    lines = ["| concurrency | requests | output tok/s | TTFT p50 / p90 / p99 ms | ITL p50 / p90 / p99 ms | e2e p50 s |",
             "|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(
            f"| {r['concurrency']} | {r['requests']} | {r['output_tok_s']:.1f} | "
            f"{r['ttft_p50_ms']:.0f} / {r['ttft_p90_ms']:.0f} / {r['ttft_p99_ms']:.0f} | "
            f"{r['itl_p50_ms']:.1f} / {r['itl_p90_ms']:.1f} / {r['itl_p99_ms']:.1f} | {r['e2e_p50_s']:.2f} |"
        )
    return "\n".join(lines)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args: argparse.Namespace, model_dir: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    command = [sys.executable, "-m", "flashdsa.cli", "serve", "--model", model_dir, "--port", str(port),
               "--device", args.device, "--mode", args.mode, "--max-num-seqs", str(max(args.concurrency)),
               "--max-queued", str(4 * max(args.concurrency))]
    if args.num_blocks:
        command += ["--num-blocks", str(args.num_blocks)]
    if args.tiny:
        command += ["--served-model-name", "tiny-shrunk"]
    process = subprocess.Popen(command, cwd=Path(__file__).resolve().parent.parent)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline and process.poll() is None:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return process, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    process.kill()
    raise RuntimeError("the server did not start")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="a running server")
    where.add_argument("--model", help="checkpoint directory to serve")
    where.add_argument("--tiny", action="store_true", help="serve a tiny shrunk random checkpoint (reference mode)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--mode", default="production", choices=["reference", "production"])
    parser.add_argument("--num-blocks", type=int, help="cache blocks of the started server")
    parser.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32, 128])
    parser.add_argument("--requests", type=int, help="requests per level (default max(8, 2 x concurrency))")
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", help="append the table to this Markdown file")
    args = parser.parse_args()

    process, tmp = None, None
    url = args.url
    if args.tiny:
        from flashdsa.models.tiny import make_tiny_checkpoint

        tmp = tempfile.TemporaryDirectory()
        args.model, args.mode = str(make_tiny_checkpoint(tmp.name, shrink=True)), "reference"
        # a small pool keeps the CPU run light; the default (1024 blocks) is sized for long prompts
        args.num_blocks = args.num_blocks or 2 * max(args.concurrency) + 16
    try:
        if url is None:
            process, url = start_server(args, args.model)
        card = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]
        warmup = random_prompts(url, 2, args.input_len, args.seed - 1)
        asyncio.run(run_level(url, card["id"], 2, warmup, 4))  # compiles kernels; not measured
        rows = []
        for c in args.concurrency:
            requests = args.requests or max(8, 2 * c)
            prompts = random_prompts(url, requests, args.input_len, args.seed + c)
            rows.append(asyncio.run(run_level(url, card["id"], c, prompts, args.output_len)))
            print(json.dumps(rows[-1]), flush=True)
    finally:
        if process is not None:
            process.terminate()
            process.wait(timeout=30)
        if tmp is not None:
            tmp.cleanup()
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    served = "server at --url" if args.url else f"{args.device}, {args.mode} mode"
    section = (f"\n## Serving: {card['id']} ({served})\n\n"
               f"{date}, commit {commit()}, input {args.input_len} tokens, output {args.output_len} tokens\n\n"
               f"{table(rows)}\n")
    print(section)
    if args.output:
        with Path(args.output).open("a") as f:
            f.write(section)


if __name__ == "__main__":
    main()
