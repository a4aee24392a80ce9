#!/usr/bin/env bash
# One H200 call: the tree's correctness record, Estimate's int8 conversions side by side,
# GPU tests, and the pre-wait loads A/B (tree vs the tree without them).
# Run from the checkout root on the H200 host (2026-12-02 06:19-06:23 UTC, tree 7bd5144).
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
timeout 170 python benchmarks/moira_correctness.py --estimators int8:mvar,int8:mvar_top8 \
  --step-launches --json "$OUT/correctness_h200.json" --timing-json "$OUT/kernel_timing_h200.json" \
  2>&1 | grep -v Warning >> "$OUT/run.log"
el correctness
timeout 100 python benchmarks/moira_correctness.py --shapes 4x131072,32x8192 \
  --estimators int8:mvar_top8,int8:mvar --only-estimators --sweep-estimate-select --no-select-sweep \
  --estimate-sweep '[{"int8_convert":"prmt"},{"int8_convert":"imma"},{"int8_convert":"prmt"},{"int8_convert":"imma"},{"int8_convert":"imma","key_stages":2},{"int8_convert":"imma","tile_pages":64},{"int8_convert":"imma","maxnreg":112}]' \
  --timing-json "$OUT/kernel_timing_imma_sweep_h200.json" 2>&1 | grep -v Warning >> "$OUT/run.log"
el sweep
MOIRA_TEST_GPU=1 timeout 120 python -m pytest -m gpu -q tests 2>&1 | tail -8 > "$OUT/pytest_gpu_h200.log"
el pytest
patch -R -p1 < benchmarks/results/prewait_loads.patch > /dev/null && bash build.sh --use-active-env > /tmp/build2.log 2>&1 \
  && timeout 100 python benchmarks/moira_correctness.py --estimators int8:mvar,int8:mvar_top8 --skip-checks \
     --step-launches --timing-json "$OUT/kernel_timing_noprewait_h200.json" 2>&1 | grep -v Warning > "$OUT/noprewait.log"
el noprewait
grep -E "^estimate |done in|copy" "$OUT/run.log" | cut -c1-200
cat "$OUT/pytest_gpu_h200.log"
