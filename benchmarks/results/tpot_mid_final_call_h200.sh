#!/usr/bin/env bash
# Call D (stop 28): Llama-3.1-8B TPOT at the three middle shapes on the final tree, dense then
# MOIRA (fixed count at the paper's gamma=0.98 reads; no coverage arm, which reads 100% on dummy weights).
# Run from the checkout root on the H200 host (2026-12-02 12:44-12:49 UTC, tree 3d23509: e23043e's kernels).
# The deadlines (135 s, engine start and the first prefill included) let only 16384x32 run in both
# arms; MOIRA also ran 32768x16. The session's device time ended with this call.
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
S=16384x32,32768x16,65536x8
timeout 175 python benchmarks/bench_tpot.py --model shared/gpu/models/Llama-3.1-8B --backend FLASH_ATTN \
  --shapes $S --gen 32 --deadline-s 135 --out "$OUT/tpot_mid_final_dense_h200.json" > "$OUT/tpot_mid_final_dense_h200.log" 2>&1
el dense rc=$?
timeout 175 python benchmarks/bench_tpot.py --model shared/gpu/models/Llama-3.1-8B --backend MOIRA --gammas "" \
  --shapes $S --gen 32 --deadline-s 135 --out "$OUT/tpot_mid_final_moira_h200.json" > "$OUT/tpot_mid_final_moira_h200.log" 2>&1
el moira rc=$?
grep -hE "tpot|SKIP|done in" "$OUT"/tpot_mid_final_*.log | tail -14
