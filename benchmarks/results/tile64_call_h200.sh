#!/usr/bin/env bash
# The tree (Estimate tile per estimator): correctness record, kernel timing, GPU tests.
# Run from the checkout root on the H200 host (2026-12-02 07:52-07:54 UTC, tree 1d30fb9: one GPU test failed, see docs/benchmarks.md).
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
timeout 200 python benchmarks/moira_correctness.py --estimators int8:mvar,int8:mvar_top8,int8:mvar_rem \
  --step-launches --json "$OUT/correctness_h200.json" --timing-json "$OUT/kernel_timing_h200.json" \
  2>&1 | grep -v Warning >> "$OUT/run.log"
el correctness
MOIRA_TEST_GPU=1 timeout 200 python -m pytest -m gpu -q tests 2>&1 | tail -8 > "$OUT/pytest_gpu_h200.log"
el pytest
cat "$OUT/pytest_gpu_h200.log"
grep -iE "estimate|select|ulp|bitwise|equal" "$OUT/run.log" | cut -c1-220 | tail -40
