#!/usr/bin/env bash
# Call A (stop 28): the serving soak's gamma=1 and dense phases on the final tree (the
# gamma=0.98 phase ran in call 1: soak_base.json), and the accuracy prompts staged in /root/acc.
# Run from the checkout root on the H200 host (2026-12-02 12:24-12:31 UTC, tree e23043e).
# benchmarks/scratch/soak_base.json is the soak_h200.json of estimate_caps_soak098_call_h200.sh (moira098).
# shellcheck disable=SC1091  # the bundle's env.sh exists only on the GPU host
set -o pipefail
export PYTHONUNBUFFERED=1
T0=$(date +%s)
el() { echo "[$(($(date +%s) - T0)) s $(date -u +%H:%M:%S)] $*" | tee -a "$OUT/run.log"; }
(rm -rf /opt/vllm030 && bash shared/gpu/install_vllm_bundle.sh .stage/vllm030 /opt/vllm030 \
  && source /opt/vllm030/env.sh && bash build.sh --use-active-env) > /tmp/build.log 2>&1 \
  || { tail -30 /tmp/build.log; exit 1; }
source /opt/vllm030/env.sh
mkdir -p /root/acc && cp .stage/accuracy/prompts.json /root/acc/
el built
cp benchmarks/scratch/soak_base.json "$OUT/soak_h200.json"
timeout 540 python benchmarks/soak_serve.py --phases moira1,dense --gamma-check --requests 100 \
  --max-len 32768 --max-tokens 128 --num-gpu-blocks 1100 --budget-s 525 \
  --out "$OUT/soak_h200.json" > "$OUT/soak.log" 2>&1
el soak rc=$?
tail -12 "$OUT/soak.log" | cut -c1-600
