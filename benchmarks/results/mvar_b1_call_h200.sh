#!/usr/bin/env bash
# TPOT with the paper's estimator (MOIRA_ESTIMATOR=mvar) at 130k x4 and 8k x32, and batch 1 at 2k-32k with
# every row through Estimate and Select (MOIRA_DENSE_BATCH_TOKENS=0), dense FA3 in the same call.
# Run from the checkout root on the H200 host (2026-12-02 09:05-09:11 UTC, tree 6869ee6).
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
M=shared/gpu/models/Llama-3.1-8B
python benchmarks/bench_tpot.py --model $M --backend FLASH_ATTN --shapes 130048x4,8192x32,2048x1,8192x1,16384x1,32768x1 \
  --gen 32 --out "$OUT/tpot_mvar_b1_dense_h200.json" > "$OUT/tpot_mvar_b1_dense_h200.log" 2>&1
el dense rc=$?
MOIRA_ESTIMATOR=mvar python benchmarks/bench_tpot.py --model $M --backend MOIRA --shapes 130048x4,8192x32 \
  --gen 32 --out "$OUT/tpot_mvar_moira_h200.json" > "$OUT/tpot_mvar_moira_h200.log" 2>&1
el mvar rc=$?
MOIRA_DENSE_BATCH_TOKENS=0 python benchmarks/bench_tpot.py --model $M --backend MOIRA --shapes 2048x1,8192x1,16384x1,32768x1 \
  --gen 32 --out "$OUT/tpot_b1_sparse_moira_h200.json" > "$OUT/tpot_b1_sparse_moira_h200.log" 2>&1
el sparse rc=$?
for f in "$OUT"/*.json; do python - "$f" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for r in d.get("rows", []):
    print(sys.argv[1].split("/")[-1], r["context"], r["batch"], r["arm"], r["selector"], r.get("reads"), r.get("tpot_ms"))
PY
done
