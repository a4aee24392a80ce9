#!/usr/bin/env bash
# The tree (flat key load in _summarize_page): GPU tests, correctness + timing for the two-slot
# int8 estimators, the prefill writer with and without the flat load (A/B, same call).
# Run from the checkout root on the H200 host (2026-12-02 07:59-08:03 UTC, tree 1d30fb9 + flatload.patch).
# shellcheck disable=SC1091  # the bundle's env.sh exists only on the GPU host
set -o pipefail
export PYTHONUNBUFFERED=1
T0=$(date +%s)
el() { echo "[$(($(date +%s) - T0)) s $(date -u +%H:%M:%S)] $*" | tee -a "$OUT/run.log"; }
(rm -rf /opt/vllm030 && bash shared/gpu/install_vllm_bundle.sh .stage/vllm030 /opt/vllm030 \
  && source /opt/vllm030/env.sh && bash build.sh --use-active-env) > /tmp/build.log 2>&1 \
  || { tail -30 /tmp/build.log; exit 1; }
source /opt/vllm030/env.sh
el built
MOIRA_TEST_GPU=1 timeout 150 python -m pytest -m gpu -q tests 2>&1 | tail -6 > "$OUT/pytest_gpu_h200.log"
el pytest
timeout 150 python benchmarks/moira_correctness.py --estimators int8:mvar,int8:mvar_top8 \
  --step-launches --json "$OUT/correctness_h200.json" --timing-json "$OUT/kernel_timing_h200.json" \
  2>&1 | grep -v Warning >> "$OUT/run.log"
el correctness
timeout 60 python benchmarks/writer_warps.py --warps 2 --windows 64 --out "$OUT/writer_flat_h200.json" > "$OUT/writer.log" 2>&1
el writer flat
patch -R -p1 < benchmarks/results/flatload.patch > /dev/null && bash build.sh --use-active-env > /tmp/build2.log 2>&1 \
  && timeout 60 python benchmarks/writer_warps.py --warps 2 --windows 64 --out "$OUT/writer_2d_h200.json" >> "$OUT/writer.log" 2>&1
el writer 2d
cat "$OUT/pytest_gpu_h200.log"
grep -E "estimator timing" "$OUT/run.log" | cut -c1-260
grep -vi warn "$OUT/writer.log" | tail -16
