#!/usr/bin/env bash
# Install Moira into vLLM 0.30.0 and serve a model with it (Hopper GPU).
#
#   bash scripts/serve.sh [MODEL_DIR_OR_ID] [extra 'vllm serve' args...]
#   bash scripts/serve.sh --yarn 4 MODEL_DIR [...]   positions stretched 4x (or 2x) with YaRN:
#                                     adds --hf-overrides (rope_parameters, from the model's
#                                     config.json) and --max-model-len (4x its positions; a
#                                     later --max-model-len wins); benchmarks/yarn_dense.py
#   bash scripts/serve.sh --check     validate the MOIRA_* environment and print the
#                                     resolved config (no GPU, no server; needs vLLM 0.30.0:
#                                     the .venv of scripts/test.sh, or an active env)
#
# Without a model, SmolLM2-135M-Instruct is prepared offline into .cache/models/ by
# scripts/prepare_model.py and served. Serving needs an NVIDIA Hopper GPU (sm_90); this is
# checked first, before anything is installed. Which installation serves:
#   - python3 sees the stock vLLM 0.30.0 (no MOIRA in its backend enum): plugin mode.
#     This package is pip-installed into that environment (--no-deps; vLLM is not
#     touched) and vllm serve runs with --attention-backend CUSTOM and the request guard;
#   - python3 sees a patched vLLM 0.30.0: build.sh --use-active-env refreshes it and the
#     MOIRA backend serves;
#   - no vLLM 0.30.0 in python3: build.sh makes the patched build in .venv.
# Environment:
#   MOIRA_BUILD_ARGS  arguments for build.sh; setting it always serves the patched build
#                     (e.g. MOIRA_BUILD_ARGS=--use-active-env patches a stock python3)
#   MOIRA_VENV        venv used in .venv mode (default .venv)
#   MOIRA_SKIP_GPU_CHECK=1  skip the Hopper check (e.g. a container without nvidia-smi
#                     and without torch in its python3)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "${ROOT}"

active_has_vllm() {
    command -v python3 >/dev/null 2>&1 || return 1
    python3 - <<'PYEOF' 2>/dev/null
import importlib.util, os, re, sys
spec = importlib.util.find_spec("vllm")
if spec is None or not spec.origin:
    sys.exit(1)
text = open(os.path.join(os.path.dirname(spec.origin), "_version.py")).read()
sys.exit(0 if re.search(r"__version__ = version = '0\.30\.0'", text) else 1)
PYEOF
}

# The active vLLM's backend enum has MOIRA (patch 0001), read without importing vLLM.
active_vllm_is_patched() {
    python3 - <<'PYEOF' 2>/dev/null
import importlib.util, os, sys
spec = importlib.util.find_spec("vllm")
registry = os.path.join(os.path.dirname(spec.origin), "v1", "attention", "backends", "registry.py")
sys.exit(0 if "\n    MOIRA = " in open(registry).read() else 1)
PYEOF
}

# Compute capabilities of the visible NVIDIA GPUs ("9.0" ...), one a line, without vLLM:
# nvidia-smi, else torch in python3.
gpu_compute_caps() {
    if command -v nvidia-smi >/dev/null 2>&1 \
        && nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null; then
        return 0
    fi
    command -v python3 >/dev/null 2>&1 || return 1
    python3 - <<'PYEOF' 2>/dev/null
import torch
for i in range(torch.cuda.device_count()):
    print("%d.%d" % torch.cuda.get_device_capability(i))
PYEOF
}

require_hopper() {
    local caps
    caps=$(gpu_compute_caps || true)
    if grep -q '^ *9\.' <<<"${caps}"; then
        return 0
    fi
    {
        echo "[serve.sh] MOIRA needs an NVIDIA Hopper GPU (H100/H200, sm_90) and none was found"
        if [[ -n "${caps//[[:space:]]/}" ]]; then
            echo "[serve.sh] compute capability of the GPUs found: $(tr '\n' ' ' <<<"${caps}")"
        else
            echo "[serve.sh] no NVIDIA GPU visible (nvidia-smi and torch.cuda found none)"
        fi
        echo "[serve.sh] nothing was installed. 'bash scripts/serve.sh --check' validates the"
        echo "[serve.sh] MOIRA_* settings without a GPU; MOIRA_SKIP_GPU_CHECK=1 skips this check."
    } >&2
    exit 1
}

venv_python() {
    echo "${MOIRA_VENV:-${ROOT}/.venv}/bin/python"
}

# --check: MOIRA_* through the backend's own parser (moira_config_from_env), on the CPU.
check_config() {
    local py
    if active_has_vllm; then
        py=python3
    else
        py=$(venv_python)
        if [[ ! -x "${py}" ]] || ! "${py}" -c "import vllm" >/dev/null 2>&1; then
            echo "[serve.sh] --check imports Moira's backend, which needs vLLM 0.30.0: run" \
                "'bash scripts/test.sh' once (it makes .venv), or activate an env with vLLM" \
                "0.30.0, or set MOIRA_VENV" >&2
            exit 2
        fi
    fi
    # The checkout's vllm_moira imports on stock and patched vLLM alike: nothing to build.
    env VLLM_TARGET_DEVICE=cpu CUDA_VISIBLE_DEVICES="" TRITON_INTERPRET=1 \
        PYTHONPATH="${ROOT}${PYTHONPATH:+:${PYTHONPATH}}" "${py}" - <<'PYEOF'
import dataclasses
import logging
import os
import sys

logging.disable(logging.WARNING)  # vLLM's import-time platform notes
try:
    from vllm_moira.v1.attention.backends.moira_config import moira_config_from_env
except ImportError as err:
    print(f"[serve.sh] --check: cannot import Moira's backend: {err}", file=sys.stderr)
    sys.exit(2)

try:
    config = moira_config_from_env()
except ValueError as err:
    print(f"[serve.sh] invalid Moira configuration: {err}", file=sys.stderr)
    sys.exit(1)
given = sorted(k for k in os.environ if k.startswith("MOIRA_"))
print("[serve.sh] Moira configuration OK (set: %s)" % (", ".join(given) or "none"))
for field in dataclasses.fields(config):
    print(f"  {field.name} = {getattr(config, field.name)!r}")
PYEOF
}

if [[ "${1:-}" == --check ]]; then
    check_config
    exit $?
fi

# --yarn FACTOR, anywhere in the arguments; checked before anything is installed.
YARN=""
REST=()
while [[ $# -gt 0 ]]; do
    case "$1" in
        --yarn)
            if [[ $# -lt 2 ]]; then
                echo "[serve.sh] --yarn needs a factor: 2 or 4" >&2
                exit 2
            fi
            YARN=$2
            shift 2
            ;;
        --yarn=*) YARN=${1#--yarn=}; shift ;;
        *) REST+=("$1"); shift ;;
    esac
done
set -- ${REST[@]+"${REST[@]}"}
if [[ -n "${YARN}" && "${YARN}" != 2 && "${YARN}" != 4 ]]; then
    echo "[serve.sh] --yarn: the factor must be 2 or 4 (YaRN over the model's trained" \
        "positions), not '${YARN}'" >&2
    exit 2
fi
if [[ "${MOIRA_SKIP_GPU_CHECK:-0}" != 1 ]]; then
    require_hopper
fi

MODE=patched
if [[ -z "${MOIRA_BUILD_ARGS+x}" ]]; then
    if active_has_vllm; then
        if active_vllm_is_patched; then MOIRA_BUILD_ARGS="--use-active-env"; else MODE=plugin; fi
    else
        MOIRA_BUILD_ARGS=""
    fi
fi

if [[ "${MODE}" == plugin ]]; then
    PY="python3"
    echo "[serve.sh] stock vLLM 0.30.0 in python3: installing Moira as a plugin (pip, --no-deps)"
    # Without build isolation when setuptools is there (offline hosts); else pip's default.
    if ! "${PY}" -m pip install -q --no-deps --force-reinstall --no-build-isolation "${ROOT}"; then
        "${PY}" -m pip install -q --no-deps --force-reinstall "${ROOT}"
    fi
else
    # shellcheck disable=SC2086  # word splitting of the argument list is intended
    bash build.sh ${MOIRA_BUILD_ARGS}
    if [[ "${MOIRA_BUILD_ARGS}" == *--use-active-env* ]]; then
        PY="python3"
    else
        PY=$(venv_python)
    fi
fi

if [[ $# -ge 1 && "$1" != -* ]]; then
    MODEL="$1"
    shift
else
    MODEL="${ROOT}/.cache/models/SmolLM2-135M-Instruct"
    if [[ ! -f "${MODEL}/config.json" ]]; then
        echo "[serve.sh] preparing SmolLM2-135M-Instruct into ${MODEL}"
        "${PY}" scripts/prepare_model.py --out "${MODEL}"
    fi
fi

YARN_ARGS=()
if [[ -n "${YARN}" ]]; then
    if [[ ! -f "${MODEL}/config.json" ]]; then
        echo "[serve.sh] --yarn needs a local model directory with config.json, not '${MODEL}'" >&2
        exit 2
    fi
    YARN_OUT=$("${PY}" "${ROOT}/benchmarks/yarn_dense.py" overrides --factor "${YARN}" \
        --model "${MODEL}") || exit 2
    YARN_ARGS=(--hf-overrides "${YARN_OUT%%$'\n'*}" --max-model-len "${YARN_OUT##*$'\n'}")
    echo "[serve.sh] YaRN factor ${YARN}: ${YARN_ARGS[*]}"
fi

if [[ "${MODE}" == plugin ]]; then
    # The request guard refuses per-request moira_gamma (a patched-build feature); the
    # `=` form takes one value, so the list cannot swallow a following argument.
    PLUGIN_ARGS=(--attention-backend=CUSTOM
        --logits-processors=vllm_moira.request_guard:MoiraRequestGuard)
    echo "[serve.sh] vllm serve ${MODEL} (plugin mode: ${PLUGIN_ARGS[*]}) $*"
    exec "${PY}" -m vllm.entrypoints.cli.main serve "${MODEL}" "${PLUGIN_ARGS[@]}" \
        ${YARN_ARGS[@]+"${YARN_ARGS[@]}"} "$@"
fi
export VLLM_ATTENTION_BACKEND=MOIRA
echo "[serve.sh] vllm serve ${MODEL} (VLLM_ATTENTION_BACKEND=MOIRA) $*"
exec "${PY}" -m vllm.entrypoints.cli.main serve "${MODEL}" ${YARN_ARGS[@]+"${YARN_ARGS[@]}"} "$@"
