#!/usr/bin/env bash
# Tensor / expert parallelism on a 2-GPU machine (nvidia-h200-x2), within one 10-minute call:
# the GPU tests, then TP 1 / TP 2 / TP 2 + EP on the tiny full-width checkpoint (bf16, reference
# mode: production's FP8 indexer flips near-ties on its own, see BENCHMARKS.md) and on the 4-layer
# V3.2-width random FP8 model (models/synthetic.py, production mode): logits cosine and greedy
# agreement against TP 1, decode tokens/s at batch 128 (DECODE: the points, default 2K and 16K
# contexts) with rank 0's host profile of the timed steps, and the NCCL collectives of a step between
# the two GPUs (benchmarks/bench_allreduce.py, with nvidia-smi's topology). Each part runs even if an
# earlier one failed. Checkpoints, per-run logs and JSON go
# to $WORK; $OUT gets only one log and the table (the device tool returns at most 8 files).
#   bash scripts/gpu_parallel.sh --output BENCHMARKS.md
set -uo pipefail
out=${OUT:-/tmp/flashdsa-gpu}
work=${WORK:-/tmp/flashdsa-parallel}
markdown=$out/BENCHMARKS-parallel.md
[[ ${1:-} == --output ]] && markdown=$2
mkdir -p "$out" "$work"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/device.txt"
status=0
part() { local name=$1; shift; echo "== $name"; timeout "$TIME" "$@" > "$work/$name.log" 2>&1 || { echo "FAILED: $name"; status=1; }; grep -v "%|" "$work/$name.log" | tail -n 60; } >> "$out/parallel.log"
# Parts may be split over calls on one warm machine: TESTS=0 skips the tests, CKPTS and SETTINGS pick
# the runs ("tiny v32"; "1,2,2 --ep"), checkpoints already in $WORK are reused, and the report
# covers every run's JSON in $WORK.
[[ ${TESTS:-1} == 1 ]] && TIME=200 part tests python3 -m pytest -q -rfE tests/parallel tests/models/test_decode_graphs_gpu.py
nvidia-smi topo -m >> "$out/parallel.log" 2>&1
TIME=60 part collectives torchrun --standalone --nproc-per-node 2 benchmarks/bench_allreduce.py
[[ -f $work/tiny/config.json ]] || TIME=60 part make-tiny python3 -m flashdsa make-tiny --overwrite "$work/tiny"
IFS=, read -ra settings <<< "${SETTINGS:-1,2,2 --ep}"
for ckpt in ${CKPTS:-tiny v32}; do
  if [[ $ckpt == v32 && ! -f $work/v32/config.json ]]; then
    TIME=90 part make-v32 python3 -c "from flashdsa.models.synthetic import v32_config, write_random_checkpoint as w; w('$work/v32', v32_config(4), device='cuda')"
  fi
  decode=""; [[ $ckpt == v32 ]] && decode="${DECODE:-128x2048,128x16384}"
  for setting in "${settings[@]}"; do
    tag=$ckpt-tp${setting// /}; tag=${tag//--/}
    mode=$([[ $ckpt == v32 ]] && echo production || echo reference)  # reference: the split alone (BENCHMARKS.md)
    TIME=$([[ $ckpt == v32 ]] && echo 240 || echo 50) part "$tag" python3 benchmarks/bench_parallel.py run --checkpoint "$work/$ckpt" --tp $setting --mode $mode --decode "$decode" --host-profile --out "$work/$tag.json"
  done
done
TIME=60 part report python3 benchmarks/bench_parallel.py report "$work"/*-tp*.json --output "$markdown"
cat "$work/report.log"
echo "2-GPU fine-tuning step time: scripts/gpu_fsdp.sh" | tee -a "$markdown"
exit $status
