#!/usr/bin/env bash
# vLLM end to end with dense steps on FA3 (the backend defaults: MOIRA_DENSE_STEPS=fa3, dense_batch_tokens 49152):
# MOIRA at gamma=1 vs FLASH_ATTN, greedy on 4 prompts of 8.2k-10.1k tokens x 64 (steps of 4 dense rows: FA3 graphs,
# class 1 and, when a page fills, class 2), mixed prefill + decode (Moira's eager step) and prefix-cache hits; first
# the page summaries written in vLLM checked against the keys (pages that fill in dense steps: class 2's writer).
# Run from the checkout root on the H200 host (2026-12-02 15:24–15:30 UTC, tree 4794177, threshold 49,152).
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
timeout 200 python benchmarks/summaries_in_vllm.py --out "$OUT/summaries_in_vllm_dense_steps_h200.json" \
  > "$OUT/summaries_in_vllm_dense_steps_h200.log" 2>&1
el summaries rc=$?
tail -5 "$OUT/summaries_in_vllm_dense_steps_h200.log" | cut -c1-600
timeout 380 python benchmarks/e2e_moira_vllm.py --timeout 185 --out "$OUT/e2e_dense_steps_h200.json" \
  > "$OUT/e2e_dense_steps_h200.log" 2>&1
el e2e rc=$?
grep -h "MOIRA: decode steps\|Graph capturing finished" "$OUT/e2e_dense_steps_h200.log" | cut -c1-200 | head
python - "$OUT/e2e_dense_steps_h200.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
print(json.dumps(d.get("summary"), indent=1)[:4000])
PY
