#!/usr/bin/env bash
# Issue 12: async-scheduled MTP decode vs synchronous, after the DeviceVerdict packing change.
# Runs the speculative tests on the GPU and the default-model MTP benchmark; logs under $OUT.
set -euo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python -m pytest -q tests/serve/test_speculative.py tests/serve/test_speculative_async.py tests/models/test_speculative_gpu.py 2>&1 | tee "$OUT/tests.log" | tail -3
timeout 240 python benchmarks/bench_mtp.py --model flashdsa/assets/default_model 2>&1 | tee "$OUT/bench_mtp.log" | tail -20
