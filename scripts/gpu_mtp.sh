#!/usr/bin/env bash
# One GPU call for multi-token prediction (issue 12): the GPU tests of speculative decoding
# (synchronous and overlapped by async scheduling), of async scheduling and of decode CUDA graphs
# (`tests`); bench_mtp.py (`bench`): batch-1 decode tokens/s of the default model with and without
# --speculative-tokens 1, both async-scheduled with CUDA graphs (the headline ratio, target 1.4x;
# the synchronous pair in the note), and the cost of an s_q=2 + MTP step against an s_q=1 step at
# batch 1, 32, 128 on the V3.2-width 4-layer random model; and on request only (`train`) the
# retrained default model with its MTP layer (into $OUT/default_model, training.json holding the
# held-out losses and acceptance rates; `bench` then times that model).
# Logs and the Markdown table land under $OUT (default /tmp/flashdsa-gpu).
# Run on the device machine as:  source .device/env.sh && FLASHDSA_COMMIT=<sha> bash scripts/gpu_mtp.sh [tests] [bench] [train]
# (no argument: tests and bench, under 5 minutes on an H100; train adds about 5 more; MTP_DISTILL=1 adds
# the stage distilling the MTP layer toward the frozen main model: training.json's acceptance should
# then rise above 0.65).
# Tiny Shakespeare is read from $DATA, else shared/data/ in the repository, else ../shared/data/.
set -uo pipefail
out=${OUT:-/tmp/flashdsa-gpu}
parts=" ${*:-tests bench} "
mkdir -p "$out"
data=${DATA:-}
for candidate in shared/data/tinyshakespeare.txt ../shared/data/tinyshakespeare.txt; do
  [[ -z $data && -f $candidate ]] && data=$candidate
done
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/device.txt"
status=0
if [[ $parts == *" tests "* ]]; then
  python3 -m pytest -q -m gpu -rfE tests/models/test_speculative_gpu.py tests/models/test_async_scheduling_gpu.py \
    tests/models/test_decode_graphs_gpu.py 2>&1 | tee "$out/mtp-tests.log" || status=1
fi
if [[ $parts == *" train "* ]]; then
  if [[ -z $data ]]; then
    echo "tinyshakespeare.txt not found: set DATA=path" | tee "$out/mtp-train.log"; exit 1
  fi
  rm -rf "$out/default_model" "$out/default_model_work"
  python3 scripts/train_default_model.py --data "$data" --output "$out/default_model" --work "$out/default_model_work" \
    ${MTP_DISTILL:+--mtp-distill} 2>&1 | tee "$out/mtp-train.log" || status=1
  cp "$out/default_model_work/training.json" "$out/default_model_work/loss.png" "$out/" 2>/dev/null
fi
if [[ $parts == *" bench "* ]]; then
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
