#!/usr/bin/env bash
# Kernel timing sanity on the tree, with Attend + Merge under both schedules on the same lists
# (Alg. 2's "lists", the kernel API default, and the backend's "pages").
# Run from the checkout root on the H200 host (2026-12-02 09:15-09:17 UTC, tree 0f7987a: the kernels of f4debb9).
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
timeout 170 python benchmarks/moira_correctness.py --skip-checks --estimators int8:mvar,int8:mvar_top8 \
  --timing-json "$OUT/kernel_timing_pages_h200.json" > "$OUT/kernel_timing_pages_run_h200.log" 2>&1
el timing rc=$?
grep -E "copy|timing|estimator timing" "$OUT/kernel_timing_pages_run_h200.log" | cut -c1-900
