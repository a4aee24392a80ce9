#!/usr/bin/env bash
# Select's geometric passes + exact finish (SELECT_LAUNCH coarse_passes / candidates) on the H200:
# GPU tests, the correctness record, kernel timing, a Select sweep against the linear passes, and
# Estimate on 4 warps (with the writer on 4: bits checked by the GPU test).
# Run from the checkout root on the H200 host (2026-12-02 11:24-11:28 UTC, tree bdbae71 = 5f4c2d1 + select_finish_variant.diff;
# its run.log says "built 5f4c2d1": a stale git HEAD in the device copy; the sweep's variant keys took effect, so its files were bdbae71's).
# Its JSON outputs are kept here as select_finish_variant_*_h200.json (the variant is not in the tree).
# shellcheck disable=SC1091  # the bundle's env.sh exists only on the GPU host
set -o pipefail
export PYTHONUNBUFFERED=1
T0=$(date +%s)
el() { echo "[$(($(date +%s) - T0)) s $(date -u +%H:%M:%S)] $*" | tee -a "$OUT/run.log"; }
(rm -rf /opt/vllm030 && bash shared/gpu/install_vllm_bundle.sh .stage/vllm030 /opt/vllm030 \
  && source /opt/vllm030/env.sh && bash build.sh --use-active-env) > /tmp/build.log 2>&1 \
  || { tail -30 /tmp/build.log; exit 1; }
source /opt/vllm030/env.sh
el built "$(git rev-parse --short HEAD 2>/dev/null)"
MOIRA_TEST_GPU=1 timeout 170 python -m pytest -m gpu -q tests > "$OUT/pytest_gpu_select_finish_h200.log" 2>&1
el pytest rc=$?
tail -4 "$OUT/pytest_gpu_select_finish_h200.log"
timeout 200 python benchmarks/moira_correctness.py --estimators int8:mvar,int8:mvar_top8 \
  --json "$OUT/correctness_h200.json" --timing-json "$OUT/kernel_timing_h200.json" \
  > "$OUT/select_finish_run_h200.log" 2>&1
el correctness rc=$?
grep -E "gamma=1|graph|select|layouts|copy|estimator timing|timing" "$OUT/select_finish_run_h200.log" | cut -c1-700
timeout 150 python benchmarks/moira_correctness.py --skip-checks --shapes 4x131072,32x8192 \
  --estimators int8:mvar --only-estimators --sweep-estimate-select --estimate-sweep '[{"num_warps": 4}, {}]' \
  --timing-json "$OUT/kernel_timing_select_finish_sweep_h200.json" >> "$OUT/select_finish_run_h200.log" 2>&1
el sweep rc=$?
grep -E "^select|^estimate" "$OUT/select_finish_run_h200.log" | cut -c1-400
MOIRA_TEST_GPU=1 MOIRA_TEST_ESTIMATE_LAUNCH='{"num_warps": 4}' timeout 100 python -m pytest -m gpu -q tests \
  -k "writes_filled_pages or writer" > "$OUT/pytest_gpu_estimate_4warps_h200.log" 2>&1
el pytest4 rc=$?
tail -4 "$OUT/pytest_gpu_estimate_4warps_h200.log"
