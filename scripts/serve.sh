#!/usr/bin/env bash
# Build Moira into vLLM 0.30.0 and serve a model with the MOIRA backend (Hopper GPU).
#
#   bash scripts/serve.sh [MODEL_DIR_OR_ID] [extra 'vllm serve' args...]
#
# Without a model, SmolLM2-135M-Instruct is prepared offline into .cache/models/ by
# scripts/prepare_model.py and served. Environment:
#   MOIRA_BUILD_ARGS  arguments for build.sh (default: --use-active-env when python3 already
#                     sees vLLM 0.30.0, e.g. the H200 PYTHONPATH bundle; else the .venv)
#   MOIRA_VENV        venv used in .venv mode (default .venv)
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

if [[ -z "${MOIRA_BUILD_ARGS+x}" ]]; then
    if active_has_vllm; then MOIRA_BUILD_ARGS="--use-active-env"; else MOIRA_BUILD_ARGS=""; fi
fi
# shellcheck disable=SC2086  # word splitting of the argument list is intended
bash build.sh ${MOIRA_BUILD_ARGS}

if [[ "${MOIRA_BUILD_ARGS}" == *--use-active-env* ]]; then
    PY="python3"
else
    PY="${MOIRA_VENV:-${ROOT}/.venv}/bin/python"
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

export VLLM_ATTENTION_BACKEND=MOIRA
echo "[serve.sh] vllm serve ${MODEL} (VLLM_ATTENTION_BACKEND=MOIRA) $*"
exec "${PY}" -m vllm.entrypoints.cli.main serve "${MODEL}" "$@"
