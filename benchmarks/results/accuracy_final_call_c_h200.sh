#!/usr/bin/env bash
# Call C (stop 28): the vLLM accuracy suite (SmolLM2-135M real weights, 300 documents) on the
# final tree: FLASH_ATTN, then MOIRA with the default (int8 mvar_top8) and with the paper's mvar.
# Run from the checkout root on the H200 host, warm from calls A and B (2026-12-02 12:31-12:39 UTC,
# tree e23043e; carry .stage/gguf/part.01, .stage/whl). The default arm hit its 170 s timeout while
# the engine shut down, after "wrote ...accuracy_moira_final_h200.json" (its log).
# shellcheck disable=SC1091  # the bundle's env.sh exists only on the GPU host
# shellcheck disable=SC2086  # $A is a command with its arguments, split on purpose
set -o pipefail
export PYTHONUNBUFFERED=1
T0=$(date +%s)
el() { echo "[$(($(date +%s) - T0)) s $(date -u +%H:%M:%S)] $*" | tee -a "$OUT/run.log"; }
source /opt/vllm030/env.sh
cat /root/acc/part.00 .stage/gguf/part.01 > /root/acc/smollm2.gguf
el "gguf $(sha256sum /root/acc/smollm2.gguf | cut -c1-64)"
pip install -q --no-deps --target /tmp/site .stage/whl/gguf-*.whl > /dev/null 2>&1
export PYTHONPATH=/tmp/site:$PYTHONPATH
python scripts/prepare_model.py --gguf /root/acc/smollm2.gguf --out /root/acc/model --dtype bfloat16 \
  > "$OUT/prepare.log" 2>&1 || { tail -20 "$OUT/prepare.log"; exit 1; }
el prepared
A="python -m benchmarks.accuracy.run_accuracy_vllm"
P=/root/acc/prompts.json
timeout 170 $A run --backend FLASH_ATTN --prompts $P --model /root/acc/model --out "$OUT/accuracy_dense_h200.json" > /tmp/dense.log 2>&1
el dense rc=$?
MOIRA_ESTIMATOR=mvar_top8 MOIRA_SUMMARY_DTYPE=int8 timeout 170 $A run --backend MOIRA --prompts $P --model /root/acc/model \
  --out "$OUT/accuracy_moira_final_h200.json" > "$OUT/accuracy_moira_final_h200.log" 2>&1
el moira default rc=$?
MOIRA_ESTIMATOR=mvar MOIRA_SUMMARY_DTYPE=int8 timeout 170 $A run --backend MOIRA --prompts $P --model /root/acc/model \
  --out "$OUT/accuracy_moira_mvar_h200.json" > "$OUT/accuracy_moira_mvar_h200.log" 2>&1
el moira mvar rc=$?
$A merge --prompts $P "$OUT/accuracy_dense_h200.json" "$OUT/accuracy_moira_final_h200.json" --out "$OUT/accuracy_smollm2_vllm_final_h200.json" > /dev/null 2>&1
$A merge --prompts $P "$OUT/accuracy_dense_h200.json" "$OUT/accuracy_moira_mvar_h200.json" --out "$OUT/accuracy_smollm2_vllm_mvar_h200.json" > /dev/null 2>&1
el merged
grep -hE "^\[(MOIRA|FLASH)" /tmp/dense.log "$OUT"/accuracy_moira_*_h200.log | cut -c1-200
