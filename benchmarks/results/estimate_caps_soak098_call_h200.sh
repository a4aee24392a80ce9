#!/usr/bin/env bash
# Call 1 (stop 28): Estimate register caps and tiles for int8 mvar (one wave at 4x131072?),
# then the serving soak on the final tree (gamma=1 vs dense, plus gamma=0.98).
# Run from the checkout root on the H200 host (2026-12-02 12:18-12:22 UTC, tree e23043e).
# Its --budget-s 430 gave each of three soak phases 143 s, under the 240 s a phase needs: moira1
# and dense were skipped (they ran in soak_final_call_h200.sh), moira098 ran.
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
timeout 150 python benchmarks/moira_correctness.py --shapes 4x131072,32x8192 \
  --estimators int8:mvar --only-estimators --sweep-estimate-select --no-select-sweep \
  --estimate-sweep '[{}, {"maxnreg":112}, {"maxnreg":104}, {"maxnreg":96}, {"maxnreg":88}, {"num_warps":4}, {"num_warps":4,"maxnreg":96}, {"tile_pages":128}, {"tile_pages":128,"maxnreg":96}, {"tile_pages":128,"num_warps":4}, {"tile_pages":128,"num_warps":4,"maxnreg":96}, {"tile_pages":128,"num_warps":4,"maxnreg":80}, {}]' \
  --timing-json "$OUT/kernel_timing_mvar_caps_h200.json" 2>&1 | grep -v Warning >> "$OUT/run.log"
el sweep
timeout 440 python benchmarks/soak_serve.py --phases moira1,dense,moira098 --gamma-check --requests 100 \
  --max-len 32768 --max-tokens 128 --num-gpu-blocks 1100 --budget-s 430 \
  --out "$OUT/soak_h200.json" > "$OUT/soak.log" 2>&1
el soak rc=$?
grep -E "^estimate |tile_pages" "$OUT/run.log" | cut -c1-240
tail -25 "$OUT/soak.log"
