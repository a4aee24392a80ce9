#!/usr/bin/env bash
# Batch 1 at 32k with the final threshold (dense_batch_tokens 36,864: the step runs FA3), dense FA3 first, one call.
# Run from the checkout root on the H200 host (2026-12-02 15:34–15:36 UTC, tree 4794177 with the backend threshold at 36,864, committed after).
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
timeout 120 python benchmarks/bench_tpot.py --model $M --backend FLASH_ATTN --shapes 32768x1 --gen 32 \
  --out "$OUT/tpot_b1_32k_final_dense_h200.json" > "$OUT/tpot_b1_32k_final_dense_h200.log" 2>&1
el dense rc=$?
timeout 130 python benchmarks/bench_tpot.py --model $M --backend MOIRA --shapes 32768x1 --gen 32 \
  --out "$OUT/tpot_b1_32k_final_moira_h200.json" > "$OUT/tpot_b1_32k_final_moira_h200.log" 2>&1
el moira rc=$?
for f in "$OUT"/*.json; do python - "$f" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for r in d.get("rows", []):
    print(sys.argv[1].split("/")[-1], r["context"], r["batch"], r["arm"], r["selector"], r.get("reads"), r.get("tpot_ms"))
PY
done
