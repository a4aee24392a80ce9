#!/usr/bin/env bash
# Batch 1 at 2k-64k with the dense-row threshold at 49,152 tokens (new default), both arms in one call;
# the sparse path at 32k (threshold 0) for the same-call A/B; TPOT with the paper's mvar at 130k x4 and 8k x32.
# Run from the checkout root on the H200 host (2026-12-02 08:47-08:57 UTC, tree f4debb9 + dense_threshold_48k.patch, reverted since).
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
MOIRA_TEST_GPU=1 python -m pytest -m gpu -q tests/v1/attention/test_moira_kernels_gpu.py -k small > "$OUT/pytest_gpu_small_h200.log" 2>&1
el pytest-small rc=$?
M=shared/gpu/models/Llama-3.1-8B
B1=2048x1,4096x1,8192x1,16384x1,32768x1,65536x1
python benchmarks/bench_tpot.py --model $M --backend FLASH_ATTN --shapes $B1,130048x4,8192x32 --gen 32 \
  --out "$OUT/tpot_b1_48k_dense_h200.json" > "$OUT/tpot_b1_48k_dense_h200.log" 2>&1
el dense rc=$?
python benchmarks/bench_tpot.py --model $M --backend MOIRA --shapes $B1 --gen 32 \
  --out "$OUT/tpot_b1_48k_moira_h200.json" > "$OUT/tpot_b1_48k_moira_h200.log" 2>&1
el moira rc=$?
MOIRA_DENSE_BATCH_TOKENS=0 python benchmarks/bench_tpot.py --model $M --backend MOIRA --shapes 32768x1 \
  --gen 32 --out "$OUT/tpot_b1_32k_sparse_h200.json" > "$OUT/tpot_b1_32k_sparse_h200.log" 2>&1
el sparse32k rc=$?
MOIRA_ESTIMATOR=mvar python benchmarks/bench_tpot.py --model $M --backend MOIRA --shapes 130048x4,8192x32 \
  --gen 32 --out "$OUT/tpot_mvar_moira_h200.json" > "$OUT/tpot_mvar_moira_h200.log" 2>&1
el mvar rc=$?
for f in "$OUT"/*.json; do python - "$f" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for r in d.get("rows", []):
    print(sys.argv[1].split("/")[-1], r["context"], r["batch"], r["arm"], r["selector"], r.get("reads"), r.get("tpot_ms"))
PY
done
