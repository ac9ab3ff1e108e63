#!/usr/bin/env bash
# One GPU call for multi-token prediction (issue 12): the GPU tests of speculative decoding and of
# decode CUDA graphs, the retrained default model with its MTP layer (into $OUT/default_model, with
# training.json holding the held-out losses and acceptance rates), and bench_mtp.py: batch-1 decode
# tokens/s of that model with and without --speculative-tokens 1 (CUDA graphs on both sides), and
# the cost of an s_q=2 + MTP step against an s_q=1 step at batch 1, 32, 128 on the V3.2-width
# 4-layer random model. Logs and the Markdown table land under $OUT (default /tmp/flashdsa-gpu).
# Run on the device machine as:  source .device/env.sh && FLASHDSA_COMMIT=<sha> bash scripts/gpu_mtp.sh [tests|train|bench]
# (no argument: all three, about 9 minutes on an H100; parts may run in separate calls: after
# `train`, copy $OUT/default_model into flashdsa/assets/default_model and `bench` times that).
# Tiny Shakespeare is read from $DATA, else shared/data/ in the repository, else ../shared/data/.
set -uo pipefail
out=${OUT:-/tmp/flashdsa-gpu}
part=${1:-all}
mkdir -p "$out"
data=${DATA:-}
for candidate in shared/data/tinyshakespeare.txt ../shared/data/tinyshakespeare.txt; do
  [[ -z $data && -f $candidate ]] && data=$candidate
done
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/device.txt"
status=0
if [[ $part == all || $part == tests ]]; then
  python3 -m pytest -q -m gpu -rfE tests/models/test_speculative_gpu.py tests/models/test_decode_graphs_gpu.py \
    2>&1 | tee "$out/mtp-tests.log" || status=1
fi
if [[ $part == all || $part == train ]]; then
  if [[ -z $data ]]; then
    echo "tinyshakespeare.txt not found: set DATA=path" | tee "$out/mtp-train.log"; exit 1
  fi
  rm -rf "$out/default_model" "$out/default_model_work"
  python3 scripts/train_default_model.py --data "$data" --output "$out/default_model" --work "$out/default_model_work" \
    2>&1 | tee "$out/mtp-train.log" || status=1
  cp "$out/default_model_work/training.json" "$out/default_model_work/loss.png" "$out/" 2>/dev/null
fi
if [[ $part == all || $part == bench ]]; then
  model=$out/default_model  # this call's retrained model, else the packaged one if it has an MTP layer
  [[ -f $model/config.json ]] || model=flashdsa/assets/default_model
  model_args=()
  if grep -q '"num_nextn_predict_layers": [1-9]' "$model/config.json" && [[ -n $data ]]; then
    model_args=(--model "$model" --data "$data")
  else
    echo "no default model with an MTP layer (or no data): timing only the V3.2-width model" | tee "$out/mtp-bench.log"
  fi
  python3 benchmarks/bench_mtp.py "${model_args[@]}" --output "$out/BENCHMARKS-mtp.md" 2>&1 | tee "$out/mtp-bench.log" || status=1
fi
exit $status
