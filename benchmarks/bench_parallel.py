"""Tensor / expert parallelism against one GPU: logits agreement and decode speed.

One process per setting (``run``), then ``report`` compares them with the TP 1 run:

    python benchmarks/bench_parallel.py run --checkpoint DIR --tp 2 [--ep] [--decode 128x2048,128x16384] --out R.json
    python benchmarks/bench_parallel.py report R1.json R2.json ... [--output BENCHMARKS.md]

``run`` teacher-forces one fixed 256-token sequence through the model (its logits at every
position, saved next to the JSON) and times decode steps at each ``batch x context`` point
through the engine (CUDA graphs), against the per-rank bytes-read bound at the copy bandwidth.
``report`` gives per-position logits cosine (min) and greedy (argmax) agreement against TP 1 on
the same checkpoint, and each decode point's tokens/s against TP 1 (target 1.6x at TP 2).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.bench_decode_indexer import copy_bandwidth  # noqa: E402
from benchmarks.bench_e2e import decode_point  # noqa: E402
from benchmarks.common import Row, report  # noqa: E402
from flashdsa.models.batch import contiguous_block_tables, step_metadata  # noqa: E402
from flashdsa.runtime.model_runner import ModelRunner  # noqa: E402
from flashdsa.runtime.parallel.launcher import load  # noqa: E402
from flashdsa.runtime.parallel.shard import ParallelConfig  # noqa: E402

QUALITY_TOKENS = 256


def run(args: argparse.Namespace) -> None:
    from transformers import AutoTokenizer

    model = load(args.checkpoint, ParallelConfig(args.tp, args.ep), "cuda", args.mode)
    ids = torch.randint(3, model.config.vocab_size, (QUALITY_TOKENS,), generator=torch.Generator().manual_seed(0))
    table = contiguous_block_tables([QUALITY_TOKENS])
    runner = ModelRunner(model, int(table.max()) + 1, model.device)
    logits = runner.forward(ids, step_metadata([0], [QUALITY_TOKENS], table, all_logits=True)).cpu()
    out = Path(args.out)
    torch.save(logits, out.with_suffix(".logits.pt"))
    del runner
    rows = []
    bandwidth = copy_bandwidth("cuda") * 1e9  # bytes/s, read + write
    tokenizer = AutoTokenizer.from_pretrained(args.checkpoint)
    for point in filter(None, args.decode.split(",")):
        batch, context = map(int, point.split("x"))
        rows += [r.__dict__ for r in decode_point(model, tokenizer, batch, context, args.steps, False, bandwidth,
                                                  host_profile=args.host_profile)]
        print(rows[-1], flush=True)
    out.write_text(json.dumps({"checkpoint": str(args.checkpoint), "tp": args.tp, "ep": args.ep, "mode": args.mode,
                               "decode": rows}))


def compare(args: argparse.Namespace) -> None:
    runs = [json.loads(Path(p).read_text()) | {"path": p} for p in args.runs]
    base = {r["checkpoint"]: r for r in runs if r["tp"] == 1}
    rows = []
    for r in runs:
        one = base.get(r["checkpoint"])
        if one is None or r is one:
            continue
        name = f"TP {r['tp']}{' + EP' if r['ep'] else ''} ({Path(r['checkpoint']).name})"
        a = torch.load(Path(one["path"]).with_suffix(".logits.pt"))
        b = torch.load(Path(r["path"]).with_suffix(".logits.pt"))
        cosine = torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=-1).min().item()
        agree = (a.argmax(-1) == b.argmax(-1)).double().mean().item()
        rows.append(Row(name, f"logits cos min {cosine:.6f}", 0.0, agree * 100, "% greedy agree", 98,
                        f"cosine target >= 0.9999 over {QUALITY_TOKENS} positions"))
        for mine, ref in zip(r["decode"], one["decode"]):
            speedup = ref["ms"] / mine["ms"]
            rows.append(Row(f"{name} decode", mine["shape"], mine["ms"], speedup, "x TP 1", 1.6 if r["tp"] == 2 else 1,
                            f"{mine['rate']:.0f}{mine['unit']} of the per-rank bound; TP 1 {ref['ms']:.2f} ms"))
    report("Tensor / expert parallelism against TP 1 (H200s, NCCL)", rows, args.output)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("run")
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--ep", action="store_true")
    p.add_argument("--decode", default="", help="batch x context points, comma separated")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--mode", choices=["production", "reference"], default="production",
                   help="precision mode; reference isolates the split from the FP8 indexer's near-tie flips")
    p.add_argument("--host-profile", action="store_true",
                   help="log rank 0's host profile of the timed decode steps (where a step waits)")
    p.add_argument("--out", required=True)
    r = sub.add_parser("report")
    r.add_argument("runs", nargs="+")
    r.add_argument("--output")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    (run if args.command == "run" else compare)(args)


if __name__ == "__main__":
    main()
