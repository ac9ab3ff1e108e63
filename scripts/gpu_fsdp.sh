#!/usr/bin/env bash
# FSDP2 fine-tuning on 2 GPUs (nvidia-h200-x2, NCCL) against 1 GPU, within 4 minutes: the tiny
# full-width checkpoint (V3.2 attention widths), sparse stage, the same global batch; prints the
# median step time of each, the speed-up and the largest relative gap between the loss curves.
# Both runs and their logs go to $WORK; $OUT gets fsdp.log (the device tool returns at most 8 files).
#   bash scripts/gpu_fsdp.sh
set -uo pipefail
out=${OUT:-/tmp/flashdsa-fsdp}
work=${WORK:-/tmp/flashdsa-fsdp-work}
mkdir -p "$out" "$work"
exec > >(tee -a "$out/fsdp.log") 2>&1
nvidia-smi --query-gpu=name,memory.total --format=csv
source "$(dirname "$0")/fsdp_inputs.sh"
args=(finetune --model "$work/tiny" --data "$work/corpus.txt" --stage sparse --steps 30 --seq-len 1024
      --batch-tokens 16384 --eval-every 1000 --eval-tokens 2048 --backend triton)
for run in one two; do
  launcher=(python3 -m flashdsa); [[ $run == two ]] && launcher=(torchrun --standalone --nproc-per-node 2 -m flashdsa)
  rm -rf "$work/$run"
  timeout 100 "${launcher[@]}" "${args[@]}" --output "$work/$run" > "$work/$run.log" 2>&1 || echo "FAILED: $run (rc $?)"
  tail -n 15 "$work/$run.log"
done
python3 - "$work" <<'PY'
import json, statistics, sys
from pathlib import Path
out = Path(sys.argv[1])
logs = {n: [json.loads(l) for l in (out / n / "log.jsonl").read_text().splitlines()] for n in ("one", "two")}
step = {n: statistics.median(r["tokens_per_s"] for r in logs[n][5:]) for n in logs}  # past warm-up
gap = max(abs(a["loss"] - b["loss"]) / abs(a["loss"]) for a, b in zip(logs["one"], logs["two"]))
print(f"tokens/s 1 GPU {step['one']:.0f}, 2 GPUs {step['two']:.0f}: {step['two'] / step['one']:.2f}x")
print(f"step time 1 GPU {16384 / step['one'] * 1e3:.1f} ms, 2 GPUs {16384 / step['two'] * 1e3:.1f} ms")
print(f"loss curves: largest relative gap {gap:.2e} over {len(logs['one'])} steps")
PY
