#!/usr/bin/env bash
# Streamed checkpoint saves and the sharded optimizer state on GPUs, within 5 minutes on one H100
# (more with 2 GPUs): the tiny full-width checkpoint (V3.2 attention widths), sparse stage.
#  1. CPU tests of the change (2- and 3-rank gloo saves, resume across rank counts).
#  2. An uninterrupted 1-GPU run against one stopped after its first step (time limit) and resumed:
#     stopped on 2 ranks (NCCL) and resumed on 1 GPU when 2 GPUs are visible, else 1 GPU both times;
#     prints the largest relative gap between the two loss curves.
#  3. save_model of the trained model from the GPU (fp32 and bf16): seconds and GB/s written.
# Logs go to $OUT (fsdpsave.log); runs to $WORK.   bash scripts/gpu_fsdpsave.sh
set -uo pipefail
out=${OUT:-/tmp/flashdsa-fsdpsave}
work=${WORK:-/tmp/flashdsa-fsdpsave-work}
mkdir -p "$out" "$work"
exec > >(tee -a "$out/fsdpsave.log") 2>&1
nvidia-smi --query-gpu=name,memory.total --format=csv
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/train/test_fsdp_checkpoint.py 2>&1 | tail -n 3
source "$(dirname "$0")/fsdp_inputs.sh"
args=(finetune --model "$work/tiny" --data "$work/corpus.txt" --stage sparse --steps 6 --seq-len 1024
      --batch-tokens 8192 --eval-every 2 --eval-tokens 2048 --backend triton --keep-best --save-dtype float32)
first=(python3 -m flashdsa)
[[ $(nvidia-smi -L | wc -l) -ge 2 ]] && first=(torchrun --standalone --nproc-per-node 2 -m flashdsa)
rm -rf "$work/straight" "$work/resumed"
timeout 100 python3 -m flashdsa "${args[@]}" --output "$work/straight" > "$work/straight.log" 2>&1 || echo "FAILED: straight (rc $?)"
timeout 100 "${first[@]}" "${args[@]}" --output "$work/resumed" --time-limit 1e-6 > "$work/stopped.log" 2>&1 || echo "FAILED: stopped (rc $?)"
timeout 100 python3 -m flashdsa "${args[@]}" --output "$work/resumed" --resume > "$work/resumed.log" 2>&1 || echo "FAILED: resumed (rc $?)"
tail -n 3 "$work/stopped.log" "$work/resumed.log"
echo "stopped on: ${first[*]}"
ls "$work/resumed/checkpoints"/*/optimizer
python3 - "$work" <<'PY'
import json, sys, time
from pathlib import Path
import torch
from flashdsa.train.architecture import load_trainable
from flashdsa.train.checkpoint import save_model
work = Path(sys.argv[1])
logs = {n: [json.loads(l) for l in (work / n / "log.jsonl").read_text().splitlines()] for n in ("straight", "resumed")}
gap = max(abs(a["loss"] - b["loss"]) / abs(a["loss"]) for a, b in zip(logs["straight"], logs["resumed"]))
print(f"resume: largest relative loss gap {gap:.2e} over {len(logs['resumed'])} steps")
model = load_trainable(work / "straight", "cuda")
for dtype in (torch.float32, torch.bfloat16):
    save_model(model, work / "save", dtype=dtype)  # warm
    torch.cuda.synchronize(); start = time.perf_counter()
    save_model(model, work / "save", dtype=dtype)
    seconds = time.perf_counter() - start
    size = sum(f.stat().st_size for f in (work / "save").glob("*.safetensors"))
    print(f"save_model {str(dtype)[6:]}: {size / 1e9:.2f} GB in {seconds:.2f} s, {size / 1e9 / seconds:.2f} GB/s")
PY
