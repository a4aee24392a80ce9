#!/usr/bin/env bash
# Call 1: int8 mvar Estimate launches side by side (both shapes), then Qwen3-4B TPOT both arms.
# Run from the checkout root on the H200 host (2026-12-02 07:26-07:33 UTC, tree bb43c43; the sweep sets each launch explicitly).
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
timeout 110 python benchmarks/moira_correctness.py --shapes 4x131072,32x8192 \
  --estimators int8:mvar --only-estimators --sweep-estimate-select --no-select-sweep \
  --estimate-sweep '[{}, {"tile_pages":64}, {"tile_pages":64,"num_warps":4}, {"tile_pages":128,"num_warps":4}, {"tile_pages":32,"num_warps":1}, {"int8_convert":"imma"}, {"int8_convert":"imma","tile_pages":64}, {"int8_convert":"imma","tile_pages":64,"num_warps":4}, {"int8_convert":"imma","tile_pages":128,"num_warps":4}, {"int8_convert":"imma","tile_pages":128,"num_warps":8}, {"int8_convert":"imma","tile_pages":32,"num_warps":1}, {"int8_convert":"imma","tile_pages":64,"num_warps":1}, {}]' \
  --timing-json "$OUT/kernel_timing_mvar_launch_h200.json" 2>&1 | grep -v Warning >> "$OUT/run.log"
el sweep
timeout 235 python benchmarks/bench_tpot.py --model shared/gpu/models/Qwen3-4B --backend FLASH_ATTN \
  --quick --deadline-s 200 --out "$OUT/tpot_qwen_now_dense_h200.json" > "$OUT/qwen_dense.log" 2>&1
el qwen dense
timeout 250 python benchmarks/bench_tpot.py --model shared/gpu/models/Qwen3-4B --backend MOIRA \
  --quick --deadline-s 215 --out "$OUT/tpot_qwen_now_moira_h200.json" > "$OUT/qwen_moira.log" 2>&1
el qwen moira
grep -E "^estimate " "$OUT/run.log" | cut -c1-260
grep -hE "tpot|TPOT" "$OUT"/qwen_*.log | tail -12
