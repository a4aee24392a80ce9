#!/usr/bin/env bash
# Serving set A side by side (one wave of 16 prompts at concurrency 16), with the run split at the last first token.
# Run from the checkout root on the H200 host (2026-12-02 08:57-09:05 UTC, tree f4debb9 + the serving phases of commit 6869ee6).
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
mkdir -p /tmp/servelogs
python benchmarks/bench_serving.py --set A --arms dense,moira --concurrency 16 --waves 1 \
  --min-prompts 2 --detailed --budget-s 555 --log-dir /tmp/servelogs \
  --out "$OUT/serving_setA_phases_h200.json" > "$OUT/serving_setA_phases_run.log" 2>&1
el serving rc=$?
for f in /tmp/servelogs/*; do tail -c 200000 "$f" > "$OUT/$(basename "$f")"; done
ls /tmp/servelogs
tail -30 "$OUT/serving_setA_phases_run.log"
