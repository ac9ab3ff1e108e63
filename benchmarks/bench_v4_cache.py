"""DeepSeek-V4's cache bytes per token of context against DeepSeek-V3.2's, as the engine allocates them.

For V4-Flash (43 layers, transformers' default schedule: 2 HCA layers, then CSA and HCA
alternating) and V4-Pro-like (61 layers, same schedule) in production mode: the paged bytes per
64-token block (CSA entries + indexer keys, HCA entries) and the fixed bytes of one sequence's state
slot (128-token window rows, compressor states), spread over the context. The anchor is V3.2 at the
same context, 61 layers x (656 + 132) B/token; the target (the V4 issue) is <= 15% of it at 128K.
No GPU needed: these are the sizes ``allocate_v4_caches`` allocates (a test checks that it does).

    python3 benchmarks/bench_v4_cache.py [--output BENCHMARKS.md]
"""

from __future__ import annotations

import datetime
from pathlib import Path

from benchmarks.common import commit, output_parser
from flashdsa.models.config import DeepseekV32Config
from flashdsa.models.deepseek_v4_caches import bytes_per_block, bytes_per_slot
from flashdsa.models.deepseek_v4_config import DeepseekV4Config
from flashdsa.runtime.cache.layout import BLOCK_SIZE, INDEXER_TOKEN_BYTES, MLA_TOKEN_BYTES

CONTEXTS = (4096, 32768, 131072, 1048576)
TARGET = 0.15  # of V3.2's bytes at 128K


def schedule(layers: int) -> list[int]:
    """transformers' default V4 layer schedule as compress ratios: HCA, HCA, then CSA / HCA alternating."""
    return [128, 128] + [4 if i % 2 else 128 for i in range(layers - 2)]


def v4_bytes_per_token(config: DeepseekV4Config, context: int) -> float:
    return bytes_per_block(config, True) / BLOCK_SIZE + bytes_per_slot(config, True) / context


def main() -> None:
    args = output_parser(__doc__).parse_args()
    v32 = DeepseekV32Config().num_hidden_layers * (MLA_TOKEN_BYTES + INDEXER_TOKEN_BYTES)
    models = {"V4-Flash (43 layers)": DeepseekV4Config(num_hidden_layers=43, compress_ratios=schedule(43)),
              "V4, 61 layers": DeepseekV4Config(num_hidden_layers=61, compress_ratios=schedule(61))}
    lines = ["| model | context | V4 B/token | V3.2 B/token | share of V3.2 | target |", "|---|---|---|---|---|---|"]
    for name, config in models.items():
        for context in CONTEXTS:
            v4 = v4_bytes_per_token(config, context)
            target = f"<= {TARGET:.0%}" if context == 131072 else ""
            lines.append(f"| {name} | {context} | {v4:.0f} | {v32} | {v4 / v32:.1%} | {target} |")
    text = "\n".join(lines)
    print(text)
    if args.output:
        date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        with Path(args.output).open("a") as f:
            f.write(f"\n## DeepSeek-V4 cache bytes per token (computed)\n\n{date}, commit {commit()}\n\n{text}\n")


if __name__ == "__main__":
    main()
