#!/usr/bin/env bash
# Batch 1 at 2k-64k: dense FA3 and Moira with all-dense steps on FA3 (MOIRA_DENSE_STEPS=fa3, the backend
# default since vLLM patch 0006), one call, dense first.
# Run from the checkout root on the H200 host (2026-12-02 14:44–14:48 UTC, tree afbfeba).
# shellcheck disable=SC1091  # the bundle's env.sh exists only on the GPU host
set -o pipefail
export PYTHONUNBUFFERED=1
T0=$(date +%s)
el() { echo "[$(($(date +%s) - T0)) s $(date -u +%H:%M:%S)] $*" | tee -a "$OUT/run.log"; }
(rm -rf /opt/vllm030 && bash shared/gpu/install_vllm_bundle.sh .stage/vllm030 /opt/vllm030 \
  && source /opt/vllm030/env.sh && bash build.sh --use-active-env) > /tmp/build.log 2>&1 \
  || { tail -30 /tmp/build.log; exit 1; }
source /opt/vllm030/env.sh
cp /tmp/build.log "$OUT/build.log"
el built "$(git rev-parse --short HEAD 2>/dev/null)"
M=shared/gpu/models/Llama-3.1-8B
B1=2048x1,4096x1,8192x1,16384x1,32768x1,65536x1
timeout 270 python benchmarks/bench_tpot.py --model $M --backend FLASH_ATTN --shapes $B1 --gen 32 \
  --out "$OUT/tpot_b1_fa3steps_dense_h200.json" > "$OUT/tpot_b1_fa3steps_dense_h200.log" 2>&1
el dense rc=$?
timeout 290 python benchmarks/bench_tpot.py --model $M --backend MOIRA --shapes $B1 --gen 32 \
  --out "$OUT/tpot_b1_fa3steps_moira_h200.json" > "$OUT/tpot_b1_fa3steps_moira_h200.log" 2>&1
el moira rc=$?
grep -h "MOIRA\|Capturing CUDA graphs\|Graph capturing finished" "$OUT"/tpot_b1_fa3steps_moira_h200.log | grep -v "^\s*$" | cut -c1-300 | sort | uniq -c | sort -rn | head -20
for f in "$OUT"/*.json; do python - "$f" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for r in d.get("rows", []):
    print(sys.argv[1].split("/")[-1], r["context"], r["batch"], r["arm"], r["selector"], r.get("reads"), r.get("tpot_ms"))
PY
done
