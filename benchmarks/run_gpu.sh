#!/usr/bin/env bash
# Run Moira's GPU tests and benchmarks on an offline Hopper host, from the checkout root.
# See --help. Every step writes NAME.json (the record) and NAME.log into --out, and
# run.json there lists the commit, whether the tree was dirty, the MOIRA_* environment
# and each step's command, exit status and seconds.
set -uo pipefail

usage() {
    cat <<'EOF'
usage: bash benchmarks/run_gpu.sh [OPTIONS] STEP [STEP...]

Installs the vLLM 0.30.0 bundle, builds Moira into it (build.sh --use-active-env),
then runs the named steps in order. Run from the checkout root on the GPU host.

Steps (NAME[:ARG]):
  gpu-tests            MOIRA_TEST_GPU=1 pytest -m gpu tests (ARG: a pytest -k expression)
  correctness[:SHAPES] moira_correctness.py: correctness record + timing sanity
                       (SHAPES default 4x131072,32x8192)
  tpot[:SHAPES]        bench_tpot.py: FLASH_ATTN, then MOIRA, then --merge into tpot.json
                       (SHAPES: CONTEXTxBATCH,... e.g. tpot:130048x4,8192x32; default:
                       the script's shapes)
  kernel-spread        bench_kernel_spread.py (CV 0, 1 and the real fractions)
  keyq-estimate[:SHAPES]
                       benchmarks/probes/keyq_estimate.py: Estimate on a 4-bit centered key
                       copy (the study's keyq4c) beside the default's Estimate on the same
                       batch, into keyq_estimate.json (SHAPES default 4x131072,32x8192)
  serving[:SET]        bench_serving.py, dense and moira arms (SET: A or B, default A)
  soak                 soak_serve.py, phases moira1 and dense
  smoke                serve_smoke.py: `vllm serve` with VLLM_ATTENTION_BACKEND=MOIRA
  e2e                  e2e_moira_vllm.py: MOIRA at gamma=1 vs FLASH_ATTN, greedy tokens
  summaries            summaries_in_vllm.py: page summaries inside vLLM vs the keys
  vllm-tests[:GAMMA]    vLLM's own backend tests with MOIRA added (patch 0007), through
                       tests/upstream/run_vllm_tests.py; needs `run_vllm_tests.py stage`
                       run beforehand on a machine with the sdist (GAMMA default 1)
  estimate-sweep[:ESTIMATORS]
                       moira_correctness.py --only-estimators --sweep-estimate-select:
                       the estimators' lists vs the reference, then Estimate under every
                       ESTIMATE_SWEEP launch (key stages, tile, warps, registers) and
                       Select under every SELECT_SWEEP launch, each checked against the
                       default's output, at 4x131072 and 32x8192, into estimate_sweep.json
                       (ESTIMATORS default int8:mvar_top8,int4:mvar_top8)
  estimate-sweep-real[:ESTIMATORS]
                       the same at Qwen2.5-Coder-1.5B's heads (--heads 12,2) and the real
                       rows' shapes 16x31744, 32x16384, 64x8192 (no model needed), into
                       estimate_sweep_real.json (ESTIMATORS default int8:mvar_top8)
  attend-sweep[:SHAPES]
                       moira_correctness.py --sweep-attend --skip-checks: every Attend
                       launch candidate (ATTEND_SWEEP: warps, stages, register caps, N_F)
                       on the same lists, into attend_sweep.json (SHAPES default
                       4x131072; with --kv-cache-dtype fp8: attend_sweep_fp8.json)
  accuracy             benchmarks/accuracy/run_accuracy_vllm.py run (FLASH_ATTN, MOIRA),
                       then merge; needs --acc-prompts and --acc-model
  accuracy-suite[:ENGINES]
                       run_accuracy_vllm.py suite: the engines side by side on the GPU,
                       then merge, into OUT/accuracy_suite (ENGINES: comma-separated of
                       dense, moira, moira_mvar, moira_int4; default
                       the first three); needs --acc-prompts
                       and --acc-model
  tpot-real[:SHAPES]   bench_tpot.py on the real model and text (--acc-model,
                       --acc-prompts), coverage rule at gamma 0.98: FLASH_ATTN, then one
                       MOIRA engine per --tpot-arms entry, then --merge into
                       tpot_real.json; each shape adds a profiled window per engine
                       (stage time per layer, rate against the copy rate, the host's
                       calls per step; SHAPES default 31744x16,16384x32,8192x64,31744x1)
  tpot-b1[:ROUNDS]     batch 1 on the real model and text (31744x1, as tpot-real): FLASH_ATTN
                       and the default alternate for ROUNDS rounds (default 3), each pair
                       merged into tpot_b1_rN.json; a step waits on the host there, and the
                       host's speed drifts between engines
  audit[:SHAPES]       the captured-mass audit's cost: bench_tpot.py on the real model and
                       text (as tpot-real), FLASH_ATTN, then MOIRA as configured (the
                       default: off) and with MOIRA_AUDIT_EVERY=64, merged into audit_tpot.json
                       (SHAPES default 31744x16,16384x32,31744x1)
  serving-real[:CONC]  bench_serving.py on the real model and text: the dataset is cut
                       from --acc-prompts (OUT/serve_text.jsonl), then the dense and moira
                       (this script's MOIRA_*, MOIRA_GAMMA default 0.98) arms, two waves
                       per concurrency (CONC default 1,16,32), into serving_real.json
  plugin-soak          soak_serve.py in plugin mode: phases plugin1 (CUSTOM at gamma 1, stock
                       vLLM with this package, as plugin-check installs it) and dense, with
                       preemption and prefix caching, outputs compared, moira_gamma refused
                       with a 400; into soak_plugin.json (dummy-weights model, no text)
  plugin-check[:SHAPES]
                       plugin mode on stock vLLM: the bundle unpacked again into PREFIX-stock
                       (no patch), this package pip-installed beside it, then
                       plugin_greedy_check.py at gamma 1 with CUSTOM (stock), MOIRA
                       (patched) and FLASH_ATTN on the real model and text, each compared
                       with FLASH_ATTN, into plugin_gamma1.json and patched_gamma1.json;
                       then bench_tpot.py on the real text at gamma 0.98 with FLASH_ATTN,
                       MOIRA and CUSTOM, into tpot_plugin.json (SHAPES default
                       31744x16,16384x32,8192x64,31744x1; FLASH_ATTN and MOIRA are taken
                       from an earlier tpot-real step of the run on the same shapes)
  yarn-dense[:FACTORS] benchmarks/yarn_dense.py run: FLASH_ATTN on the real model with YaRN
                       (dense qualification of each length): unscaled at 32k, factor 2 at 32k/64k, factor 4 at
                       32k-128k; needles and perplexity, into yarn_dense.json (parts
                       yarn_dense_fF.json; a part holding a length skips it, so a second
                       call with the same --out continues). FACTORS: comma-separated of
                       1, 2, 4 (default all). Needs --yarn-prompts and --acc-model; with
                       --step-timeout it stops 30 s before it, between lengths

Options:
  --out DIR            output directory (required; created)
  --shared DIR         the shared GPU kit: install_vllm_bundle.sh, models (default .shared)
  --bundle DIR         vLLM bundle parts (default .stage/vllm030)
  --prefix DIR         where the bundle is unpacked (default /opt/vllm030)
  --no-install         reuse an already installed and built PREFIX
  --step-timeout S     kill a step after S seconds (default: none)
  --kv-cache-dtype D   auto (bf16, default) or fp8 (e4m3, per-layer scales): passed to
                       correctness, tpot (both backends), summaries and accuracy; their
                       records get the suffix _fp8
  --acc-prompts FILE   accuracy prompts (run_accuracy_vllm export; default
                       .stage/accuracy/prompts.json); also the text of tpot-real and
                       serving-real
  --tpot-arms LIST     tpot-real's MOIRA engines, space-separated (default "moira
                       mvar"): moira (as configured: the default when no MOIRA_* is
                       set), mvar (MOIRA_ESTIMATOR=mvar), int4 / int8 (that
                       MOIRA_SUMMARY_DTYPE), audit (MOIRA_AUDIT_EVERY=64)
  --yarn-prompts FILE  yarn_dense.py export (default .stage/yarn/prompts.json.gz)
  --acc-model DIR      accuracy model, a local HF directory (scripts/prepare_model.py or
                       scripts/gpu_carry_model.py assemble; default .stage/accuracy/model);
                       also the model of tpot-real, serving-real and yarn-dense
  -h, --help           this text

The Moira configuration is the MOIRA_* environment this script is started with;
it is recorded in run.json, with the commit (git rev-parse HEAD, or RUN_GPU_COMMIT
where the tree was copied without its history). Example:
  MOIRA_GAMMA=0.98 bash benchmarks/run_gpu.sh --out /tmp/out gpu-tests correctness \
      tpot:130048x4,8192x32
EOF
}

OUT=""
SHARED=".shared"
BUNDLE=".stage/vllm030"
PREFIX="/opt/vllm030"
INSTALL=1
STEP_TIMEOUT=0
KV_DTYPE="auto"
ACC_PROMPTS=".stage/accuracy/prompts.json"
ACC_MODEL=".stage/accuracy/model"
TPOT_ARMS="moira mvar"
YARN_PROMPTS=".stage/yarn/prompts.json.gz"
NEED_YARN=0
STEPS=()
NEED_REAL_MODEL=0

need_value() {
    if [[ $# -lt 2 || -z "$2" ]]; then
        echo "run_gpu.sh: $1 needs a value" >&2
        exit 2
    fi
}

while [[ $# -gt 0 ]]; do
    case "$1" in
        --out) need_value "$@"; OUT=$2; shift ;;
        --shared) need_value "$@"; SHARED=$2; shift ;;
        --bundle) need_value "$@"; BUNDLE=$2; shift ;;
        --prefix) need_value "$@"; PREFIX=$2; shift ;;
        --no-install) INSTALL=0 ;;
        --step-timeout) need_value "$@"; STEP_TIMEOUT=$2; shift ;;
        --kv-cache-dtype) need_value "$@"; KV_DTYPE=$2; shift ;;
        --acc-prompts) need_value "$@"; ACC_PROMPTS=$2; shift ;;
        --acc-model) need_value "$@"; ACC_MODEL=$2; shift ;;
        --tpot-arms) need_value "$@"; TPOT_ARMS=$2; shift ;;
        --yarn-prompts) need_value "$@"; YARN_PROMPTS=$2; shift ;;
        -h | --help) usage; exit 0 ;;
        -*) echo "run_gpu.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
        *) STEPS+=("$1") ;;
    esac
    shift
done

if [[ -z "${OUT}" ]]; then
    echo "run_gpu.sh: --out DIR is required (see --help)" >&2
    exit 2
fi
case "${KV_DTYPE}" in
    auto | fp8) ;;
    *) echo "run_gpu.sh: --kv-cache-dtype must be auto or fp8, not '${KV_DTYPE}'" >&2; exit 2 ;;
esac
# Records of an fp8 run are named apart, so one --out can hold both.
SUFFIX=""
[[ "${KV_DTYPE}" == fp8 ]] && SUFFIX="_fp8"
KV_ARGS=(--kv-cache-dtype "${KV_DTYPE}")
for arm in ${TPOT_ARMS}; do
    case "${arm}" in
        moira | mvar | int4 | int8 | audit) ;;
        *) echo "run_gpu.sh: --tpot-arms takes moira, mvar, int4, int8 and audit," \
            "not '${arm}'" >&2; exit 2 ;;
    esac
done
if [[ ${#STEPS[@]} -eq 0 ]]; then
    echo "run_gpu.sh: no step named (see --help)" >&2
    exit 2
fi
for step in "${STEPS[@]}"; do
    case "${step%%:*}" in
        gpu-tests | correctness | tpot | kernel-spread | keyq-estimate | serving | soak | smoke | e2e \
            | plugin-soak \
            | summaries | vllm-tests | accuracy | estimate-sweep | estimate-sweep-real | attend-sweep) ;;
        accuracy-suite | tpot-real | tpot-b1 | serving-real | plugin-check | audit)
            NEED_REAL_MODEL=1 ;;
        yarn-dense) NEED_YARN=1 ;;
        *) echo "run_gpu.sh: unknown step '${step}' (see --help)" >&2; exit 2 ;;
    esac
done
if [[ ! -f build.sh || ! -d benchmarks ]]; then
    echo "run_gpu.sh: run it from the checkout root" >&2
    exit 2
fi
# The real-model steps cannot do anything without the model and its text: say so before
# the install and engine starts spend device time.
if [[ ${NEED_REAL_MODEL} == 1 && ( ! -f "${ACC_PROMPTS}" || ! -d "${ACC_MODEL}" ) ]]; then
    echo "run_gpu.sh: accuracy-suite, tpot-real, serving-real and plugin-check need --acc-prompts FILE" \
        "(${ACC_PROMPTS}) and --acc-model DIR (${ACC_MODEL}); see scripts/prepare_model.py" >&2
    exit 2
fi
if [[ ${NEED_YARN} == 1 && ( ! -f "${YARN_PROMPTS}" || ! -d "${ACC_MODEL}" ) ]]; then
    echo "run_gpu.sh: yarn-dense needs --yarn-prompts FILE (${YARN_PROMPTS}) and --acc-model" \
        "DIR (${ACC_MODEL}); see benchmarks/yarn_dense.py export" >&2
    exit 2
fi

mkdir -p "${OUT}"
OUT=$(cd "${OUT}" && pwd)
MODELS="${SHARED}/gpu/models"
MODEL="${MODELS}/Llama-3.1-8B"
TOKENIZER="${MODELS}/tokenizer-smollm2"
export PYTHONUNBUFFERED=1
T0=$(date +%s)
log() { echo "[run_gpu $(($(date +%s) - T0)) s] $*" | tee -a "${OUT}/run.log"; }

# run.json: written once here, each step appended by record_step.
# A copy of the tree without its git history (a machine the checkout was synced to) names
# its commit in RUN_GPU_COMMIT; it is then recorded as given, not checked.
COMMIT=${RUN_GPU_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
DIRTY=false
if [[ -z "${RUN_GPU_COMMIT:-}" && -n "$(git status --porcelain --untracked-files=no 2>/dev/null)" ]]; then
    DIRTY=true
fi
python3 - "${OUT}/run.json" "${COMMIT}" "${DIRTY}" <<'PYEOF'
import json, os, sys
path, commit, dirty = sys.argv[1:]
moira = {k: v for k, v in sorted(os.environ.items()) if k.startswith("MOIRA_")}
json.dump({"commit": commit, "dirty": dirty == "true", "moira_env": moira, "steps": []},
          open(path, "w"), indent=1)
PYEOF

record_step() {  # NAME RC SECONDS COMMAND...
    python3 - "${OUT}/run.json" "$@" <<'PYEOF'
import json, sys
path, name, rc, seconds, *command = sys.argv[1:]
run = json.load(open(path))
run["steps"].append({"step": name, "rc": int(rc), "seconds": int(seconds),
                     "command": " ".join(command)})
json.dump(run, open(path, "w"), indent=1)
PYEOF
}

FAILED=0
# run NAME CMD...: run one command, its output to NAME.log, recorded in run.json.
run() {
    local name=$1 t rc
    shift
    log "${name}: $*"
    t=$(date +%s)
    if [[ "${STEP_TIMEOUT}" != 0 ]]; then
        timeout "${STEP_TIMEOUT}" "$@" >"${OUT}/${name}.log" 2>&1
    else
        "$@" >"${OUT}/${name}.log" 2>&1
    fi
    rc=$?
    record_step "${name}" "${rc}" "$(($(date +%s) - t))" "$@"
    log "${name}: rc=${rc}"
    tail -5 "${OUT}/${name}.log"
    [[ ${rc} == 0 ]] || FAILED=1
    return "${rc}"
}
# The stock vLLM 0.30.0 package (the bundle unpacked again, no patch) with this package
# pip-installed beside it: plugin mode. Once per run; the plugin steps share it.
# (Reinstalled by every run: an earlier run's copy may hold older code of this package.)
STOCK="${PREFIX}-stock"
STOCK_INSTALLED=0
stock_install() {
    [[ ${STOCK_INSTALLED} == 1 ]] && return 0
    rm -rf "${STOCK}"
    run plugin_install bash -c "bash '${SHARED}/gpu/install_vllm_bundle.sh' \
        '${BUNDLE}' '${STOCK}' && python3 -m pip install -q --no-deps \
        --no-build-isolation --target '${STOCK}/plugin' ." && STOCK_INSTALLED=1
}

if [[ ${INSTALL} == 1 ]]; then
    log "install the vLLM bundle (${BUNDLE} -> ${PREFIX}) and build Moira"
    rm -rf "${PREFIX}"
    if ! bash "${SHARED}/gpu/install_vllm_bundle.sh" "${BUNDLE}" "${PREFIX}" >"${OUT}/build.log" 2>&1; then
        tail -30 "${OUT}/build.log"
        exit 1
    fi
fi
if [[ ! -f "${PREFIX}/env.sh" ]]; then
    echo "run_gpu.sh: ${PREFIX}/env.sh not found (drop --no-install?)" >&2
    exit 1
fi
# shellcheck disable=SC1091  # written by install_vllm_bundle.sh on the GPU host
source "${PREFIX}/env.sh"
if [[ ${INSTALL} == 1 ]] && ! bash build.sh --use-active-env >>"${OUT}/build.log" 2>&1; then
    tail -30 "${OUT}/build.log"
    exit 1
fi
log "built at ${COMMIT} (dirty: ${DIRTY})"

# bench_tpot.py engines of one step: FLASH_ATTN, then MOIRA once per mode ("moira": the
# environment's MOIRA_*; "mvar": MOIRA_ESTIMATOR=mvar;
# "int4" / "int8": that MOIRA_SUMMARY_DTYPE; "audit": MOIRA_AUDIT_EVERY=64),
# each into OUT/NAME_MODE.json,
# then --merge into OUT/NAME.json once the dense record and a MOIRA one exist.
# tpot_engines NAME "MODES" "MOIRA-ONLY ARGS" BENCH_TPOT_ARGS...
tpot_engines() {
    local name=$1 modes=$2 mode part
    local -a moira_args parts=() env_args
    read -r -a moira_args <<<"$3"
    shift 3
    for mode in dense ${modes}; do
        part="${OUT}/${name}_${mode}.json"
        if [[ ${mode} == dense ]]; then
            run "${name}_dense" python benchmarks/bench_tpot.py "$@" --backend FLASH_ATTN \
                --out "${part}"
        else
            case ${mode} in
                moira) env_args=() ;;
                mvar) env_args=(MOIRA_ESTIMATOR=mvar) ;;
                int4 | int8) env_args=(MOIRA_SUMMARY_DTYPE="${mode}") ;;
                audit) env_args=(MOIRA_AUDIT_EVERY=64) ;;
            esac
            run "${name}_${mode}" env ${env_args[@]+"${env_args[@]}"} python \
                benchmarks/bench_tpot.py "$@" --backend MOIRA \
                ${moira_args[@]+"${moira_args[@]}"} --out "${part}"
        fi
        [[ -f "${part}" ]] && parts+=("${part}")
    done
    if [[ -f "${OUT}/${name}_dense.json" && ${#parts[@]} -ge 2 ]]; then
        run "${name}" python benchmarks/bench_tpot.py --merge "${parts[@]}" \
            --out "${OUT}/${name}.json"
    fi
}

for step in "${STEPS[@]}"; do
    name=${step%%:*}
    arg=""
    [[ "${step}" == *:* ]] && arg=${step#*:}
    case "${name}" in
        gpu-tests)
            run gpu_tests env MOIRA_TEST_GPU=1 python -m pytest -m gpu -q tests \
                ${arg:+-k "${arg}"}
            ;;
        correctness)
            run "correctness${SUFFIX}" python benchmarks/moira_correctness.py "${KV_ARGS[@]}" \
                --shapes "${arg:-4x131072,32x8192}" --json "${OUT}/correctness${SUFFIX}.json" \
                --timing-json "${OUT}/correctness${SUFFIX}_timing.json"
            ;;
        estimate-sweep)
            run "estimate_sweep${SUFFIX}" python benchmarks/moira_correctness.py "${KV_ARGS[@]}" \
                --only-estimators --sweep-estimate-select \
                --json "${OUT}/estimate_sweep_checks${SUFFIX}.json" \
                --estimators "${arg:-int8:mvar_top8,int4:mvar_top8}" --shapes 4x131072,32x8192 \
                --timing-json "${OUT}/estimate_sweep${SUFFIX}.json"
            ;;
        estimate-sweep-real)
            # The same sweep at the real-weights rows' geometry (Qwen2.5-Coder-1.5B: 12 query
            # and 2 KV heads) and TPOT shapes: far fewer (row, KV head) lists than Llama's.
            run "estimate_sweep_real${SUFFIX}" python benchmarks/moira_correctness.py \
                "${KV_ARGS[@]}" --only-estimators --sweep-estimate-select --heads 12,2 \
                --json "${OUT}/estimate_sweep_real_checks${SUFFIX}.json" \
                --estimators "${arg:-int8:mvar_top8}" --shapes 16x31744,32x16384,64x8192 \
                --timing-json "${OUT}/estimate_sweep_real${SUFFIX}.json"
            ;;
        attend-sweep)
            run "attend_sweep${SUFFIX}" python benchmarks/moira_correctness.py "${KV_ARGS[@]}" \
                --sweep-attend --skip-checks --shapes "${arg:-4x131072}" \
                --timing-json "${OUT}/attend_sweep${SUFFIX}.json"
            ;;
        tpot)
            shapes=()
            [[ -n "${arg}" ]] && shapes=(--shapes "${arg}")
            tpot_engines "tpot${SUFFIX}" moira "" --model "${MODEL}" "${KV_ARGS[@]}" \
                "${shapes[@]}"
            ;;
        keyq-estimate)
            run keyq_estimate python -m benchmarks.probes.keyq_estimate --sweep \
                --shapes "${arg:-4x131072,32x8192}" --out "${OUT}/keyq_estimate.json"
            ;;
        kernel-spread)
            fractions=benchmarks/results/kernel_spread/real_fractions_smollm2.json
            if [[ -f "${fractions}" ]]; then
                run kernel_spread python benchmarks/bench_kernel_spread.py \
                    --real-fractions "${fractions}" --out "${OUT}/kernel_spread.json"
            else
                run kernel_spread python benchmarks/bench_kernel_spread.py --cvs 0,1 \
                    --out "${OUT}/kernel_spread.json"
            fi
            ;;
        serving)
            run "serving_set${arg:-A}" python benchmarks/bench_serving.py --set "${arg:-A}" \
                --model "${MODEL}" --tokenizer "${TOKENIZER}" --log-dir "${OUT}" \
                --out "${OUT}/serving_set${arg:-A}.json"
            ;;
        soak)
            run soak python benchmarks/soak_serve.py --phases moira1,dense --model "${MODEL}" \
                --tokenizer "${TOKENIZER}" --out "${OUT}/soak.json"
            ;;
        smoke)
            run smoke python benchmarks/serve_smoke.py --model "${MODEL}" \
                --tokenizer "${TOKENIZER}" --out "${OUT}/smoke.json"
            ;;
        e2e)
            run e2e python benchmarks/e2e_moira_vllm.py --model "${MODEL}" --out "${OUT}/e2e.json"
            ;;
        summaries)
            run "summaries${SUFFIX}" python benchmarks/summaries_in_vllm.py --model "${MODEL}" \
                "${KV_ARGS[@]}" --out "${OUT}/summaries${SUFFIX}.json"
            ;;
        vllm-tests)
            run "vllm_tests_gamma${arg:-1}" python tests/upstream/run_vllm_tests.py run \
                --gamma "${arg:-1}" --out "${OUT}"
            ;;
        accuracy)
            if [[ ! -f "${ACC_PROMPTS}" || ! -d "${ACC_MODEL}" ]]; then
                log "accuracy: needs --acc-prompts FILE (${ACC_PROMPTS}) and --acc-model DIR (${ACC_MODEL})"
                FAILED=1
                continue
            fi
            for backend in FLASH_ATTN MOIRA; do
                run "accuracy${SUFFIX}_${backend,,}" python -m benchmarks.accuracy.run_accuracy_vllm \
                    run "${KV_ARGS[@]}" --backend "${backend}" --prompts "${ACC_PROMPTS}" \
                    --model "${ACC_MODEL}" --out "${OUT}/accuracy${SUFFIX}_${backend,,}.json"
            done
            run "accuracy${SUFFIX}" python -m benchmarks.accuracy.run_accuracy_vllm merge \
                "${OUT}/accuracy${SUFFIX}_flash_attn.json" "${OUT}/accuracy${SUFFIX}_moira.json" \
                --prompts "${ACC_PROMPTS}" --out "${OUT}/accuracy${SUFFIX}.json"
            ;;
        accuracy-suite)
            engines=()
            [[ -n "${arg}" ]] && IFS=, read -r -a engines <<<"${arg}"
            run "accuracy_suite${SUFFIX}" python -m benchmarks.accuracy.run_accuracy_vllm suite \
                --prompts "${ACC_PROMPTS}" --model "${ACC_MODEL}" "${KV_ARGS[@]}" \
                ${engines[@]+--engines "${engines[@]}"} --out-dir "${OUT}/accuracy_suite${SUFFIX}"
            ;;
        tpot-real)
            real_shapes="${arg:-31744x16,16384x32,8192x64,31744x1}"
            # Each shape also gets one profiled window per engine: the stages' time per
            # layer and rate against the copy rate, and the step's time outside the kernels
            # (bench_tpot --breakdown); at batch 1 the step is FA3's own graph.
            # --gen 32: a real-weight engine per arm leaves less of a call for steps.
            tpot_engines "tpot_real${SUFFIX}" "${TPOT_ARMS}" "--gammas 0.98 --no-fixed" \
                --model "${ACC_MODEL}" --prompts "${ACC_PROMPTS}" "${KV_ARGS[@]}" \
                --shapes "${real_shapes}" --gen 32 --breakdown "${real_shapes}"
            REAL_SHAPES_RUN=${real_shapes}
            ;;
        tpot-b1)
            # Batch 1 waits on the host (graph launch, the runner's Python), whose speed
            # drifts between engine processes: dense and the default alternate, a pair of
            # engines per round, each round merged on its own.
            rounds=${arg:-3}
            for ((r = 1; r <= rounds; r++)); do
                tpot_engines "tpot_b1_r${r}${SUFFIX}" moira "--gammas 0.98 --no-fixed" \
                    --model "${ACC_MODEL}" --prompts "${ACC_PROMPTS}" "${KV_ARGS[@]}" \
                    --shapes 31744x1 --gen 64
            done
            ;;
        audit)
            # The same engines but for the audit: the default (MOIRA_* unset: off), then
            # every 64 steps; rows name it (audit_every), so the merge keeps both beside dense.
            tpot_engines "audit_tpot${SUFFIX}" "moira audit" "--gammas 0.98 --no-fixed" \
                --model "${ACC_MODEL}" --prompts "${ACC_PROMPTS}" "${KV_ARGS[@]}" \
                --shapes "${arg:-31744x16,16384x32,31744x1}" --gen 32
            ;;
        plugin-soak)
            stock_install || continue
            run plugin_soak bash -c "source '${STOCK}/env.sh' && \
                PYTHONPATH='${STOCK}/plugin':\"\${PYTHONPATH}\" python benchmarks/soak_serve.py \
                --phases plugin1,dense --gamma-check --model '${MODEL}' \
                --tokenizer '${TOKENIZER}' --out '${OUT}/soak_plugin.json'"
            ;;
        plugin-check)
            stock="${STOCK}"
            greedy=(python benchmarks/plugin_greedy_check.py --model "${ACC_MODEL}"
                --prompts "${ACC_PROMPTS}")
            stock_install || continue
            run plugin_dense "${greedy[@]}" --backend FLASH_ATTN --out "${OUT}/greedy_dense.json"
            run plugin_patched env MOIRA_GAMMA=1 MOIRA_DENSE_BATCH_TOKENS=0 "${greedy[@]}" \
                --backend MOIRA --out "${OUT}/greedy_patched.json"
            # The stock package and the plugin first on the path, in a child shell so that
            # the patched environment stays for the later steps.
            run plugin_custom bash -c "source '${stock}/env.sh' && \
                PYTHONPATH='${stock}/plugin':\"\${PYTHONPATH}\" MOIRA_GAMMA=1 \
                MOIRA_DENSE_BATCH_TOKENS=0 ${greedy[*]} --backend CUSTOM \
                --out '${OUT}/greedy_custom.json'"
            for arm in custom patched; do
                [[ -f "${OUT}/greedy_${arm}.json" && -f "${OUT}/greedy_dense.json" ]] || continue
                run "plugin_compare_${arm}" python benchmarks/plugin_greedy_check.py --compare \
                    "${OUT}/greedy_${arm}.json" "${OUT}/greedy_dense.json" \
                    --out "${OUT}/$([[ ${arm} == custom ]] && echo plugin || echo patched)_gamma1.json"
            done
            tpot=(python benchmarks/bench_tpot.py --model "${ACC_MODEL}" --prompts "${ACC_PROMPTS}"
                --shapes "${arg:-31744x16,16384x32,8192x64,31744x1}" --gen 32)
            # The dense and patched engines of a tpot-real step of this run, on the same
            # shapes, text and environment, are the plugin's baseline: not run twice.
            if [[ -f "${OUT}/tpot_real_dense.json" && -f "${OUT}/tpot_real_moira.json" \
                && "${arg:-31744x16,16384x32,8192x64,31744x1}" == "${REAL_SHAPES_RUN:-}" ]]; then
                cp "${OUT}/tpot_real_dense.json" "${OUT}/tpot_plugin_dense.json"
                cp "${OUT}/tpot_real_moira.json" "${OUT}/tpot_plugin_patched.json"
            else
                run plugin_tpot_dense "${tpot[@]}" --backend FLASH_ATTN \
                    --out "${OUT}/tpot_plugin_dense.json"
                run plugin_tpot_patched "${tpot[@]}" --backend MOIRA --gammas 0.98 \
                    --no-fixed --out "${OUT}/tpot_plugin_patched.json"
            fi
            run plugin_tpot_custom bash -c "source '${stock}/env.sh' && \
                PYTHONPATH='${stock}/plugin':\"\${PYTHONPATH}\" ${tpot[*]} --backend CUSTOM \
                --gammas 0.98 --no-fixed --out '${OUT}/tpot_plugin_custom.json'"
            parts=()
            for arm in dense patched custom; do
                [[ -f "${OUT}/tpot_plugin_${arm}.json" ]] && parts+=("${OUT}/tpot_plugin_${arm}.json")
            done
            if [[ ${#parts[@]} -ge 2 && -f "${OUT}/tpot_plugin_dense.json" ]]; then
                run plugin_tpot python benchmarks/bench_tpot.py --merge "${parts[@]}" \
                    --out "${OUT}/tpot_plugin.json"
            fi
            ;;
        serving-real)
            dataset="${OUT}/serve_text.jsonl"
            run serving_real_dataset python benchmarks/bench_serving.py \
                --make-dataset "${dataset}" --from-prompts "${ACC_PROMPTS}" \
                --tokenizer "${ACC_MODEL}" || continue
            # Two real-weight server starts (~150 s each) and 1,024-token answers at three
            # concurrencies: the default 570 s budget is too short.
            # The moira server runs as this script is configured (its MOIRA_*), at γ 0.98
            # unless MOIRA_GAMMA says otherwise.
            serve_env=$(env | grep '^MOIRA_' | grep -v '^MOIRA_GAMMA=' | sort | paste -sd, -)
            serve_env="MOIRA_GAMMA=${MOIRA_GAMMA:-0.98}${serve_env:+,${serve_env}}"
            run serving_real python benchmarks/bench_serving.py --model "${ACC_MODEL}" \
                --tokenizer "${ACC_MODEL}" --dataset "${dataset}" \
                --concurrency "${arg:-1,16,32}" --waves 2 --moira-env "${serve_env}" \
                --detailed --budget-s 900 --log-dir "${OUT}" --out "${OUT}/serving_real.json"
            ;;
        yarn-dense)
            factors=()
            [[ -n "${arg}" ]] && IFS=, read -r -a factors <<<"${arg}"
            budget=()
            [[ "${STEP_TIMEOUT}" != 0 ]] && budget=(--budget-s "$((STEP_TIMEOUT - 30))")
            run yarn_dense python benchmarks/yarn_dense.py run --prompts "${YARN_PROMPTS}" \
                --model "${ACC_MODEL}" ${factors[@]+--factors "${factors[@]}"} \
                ${budget[@]+"${budget[@]}"} --out "${OUT}/yarn_dense.json"
            ;;
    esac
done

log "done; records and logs in ${OUT} (run.json: commit, MOIRA_* env, steps)"
exit "${FAILED}"
