#!/usr/bin/env bash
# What the 49,152-token threshold gives up: dense FA3 vs Moira's sparse step (MOIRA_DENSE_BATCH_TOKENS=32768, so
# these steps stay sparse) at batch 1 x 44k and batch 4 x 11k (fixed arm at 0.3), one call, dense first.
# Run from the checkout root on the H200 host (2026-12-02 15:30–15:33 UTC, tree 4794177).
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
M=shared/gpu/models/Llama-3.1-8B
S=45056x1,11264x4
timeout 200 python benchmarks/bench_tpot.py --model $M --backend FLASH_ATTN --shapes $S --gen 32 \
  --out "$OUT/tpot_threshold_dense_h200.json" > "$OUT/tpot_threshold_dense_h200.log" 2>&1
el dense rc=$?
MOIRA_DENSE_BATCH_TOKENS=32768 timeout 200 python benchmarks/bench_tpot.py --model $M --backend MOIRA \
  --shapes $S --gen 32 --fixed-fractions 11264x4=0.3 \
  --out "$OUT/tpot_threshold_sparse_h200.json" > "$OUT/tpot_threshold_sparse_h200.log" 2>&1
el sparse rc=$?
for f in "$OUT"/*.json; do python - "$f" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for r in d.get("rows", []):
    print(sys.argv[1].split("/")[-1], r["context"], r["batch"], r["arm"], r["selector"], r.get("reads"), r.get("tpot_ms"))
PY
done
