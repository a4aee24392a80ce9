#!/usr/bin/env bash
# Turn a stock vLLM 0.30.0 into the Moira build: apply patches/series to the installed
# vllm package and copy the vllm_moira/ overlay into it. Idempotent. See --help.
set -euo pipefail

VLLM_VERSION="0.30.0"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

usage() {
    cat <<EOF
Usage: bash build.sh [OPTIONS]

Turn a stock vLLM ${VLLM_VERSION} into the Moira build (idempotent):
  1. find the installed vllm package (never imports it),
  2. apply patches/series in order (already-applied patches are skipped),
  3. copy the vllm_moira/v1/ overlay into the vllm package tree
     (vllm_moira/v1/x.py -> <site>/vllm/v1/x.py; existing __init__.py files are kept;
     the package's top-level modules, e.g. the plugin entry point, are not copied).

Environment selection (default: project venv):
  (default)               use the venv \$MOIRA_VENV (default: ${ROOT}/.venv); create it
                          and 'pip install vllm==${VLLM_VERSION}' into it when missing
  --use-active-env        use the active interpreter (python3 on PATH, or --python) instead;
                          also MOIRA_USE_ACTIVE_ENV=1. An importable vllm ${VLLM_VERSION} (site-packages
                          or PYTHONPATH bundle) is used as is and never pip-installed over;
                          if vllm is missing it is pip-installed (unless MOIRA_NO_PIP=1)
  --python PATH           interpreter to use (implies --use-active-env)
  --target-vllm DIR       patch this vllm package directory directly (the dir that holds
                          vllm/__init__.py); no interpreter, no pip
  --patches DIR           patch directory holding 'series' (default: ${ROOT}/patches;
                          also MOIRA_PATCHES_DIR)
  --import-check          after building, import vllm.v1.attention.backends.moira
                          (needs a working vllm import on this machine)

Check mode (installs nothing):
  --check                 apply the series, in order, to a clean vLLM ${VLLM_VERSION} source tree
                          in a temp dir and report. The sdist is cached under
                          \$MOIRA_CACHE_DIR (default: ${ROOT}/.cache); MOIRA_VLLM_SDIST=FILE
                          uses a given vllm-${VLLM_VERSION}.tar.gz
  --vllm-src DIR          with --check: use this vLLM ${VLLM_VERSION} source tree (copied, not modified)
  --fetch-sdist           only download the sdist into the cache and exit

  -h, --help              this text

Exit status: 0 on success; nonzero with the failing patch named otherwise.
Patches are applied with GNU patch (-p1, no fuzz) into the parent of the vllm dir;
without 'patch' on PATH, 'git apply' is used.
EOF
}

log() { printf '[build.sh] %s\n' "$*"; }
die() {
    printf '[build.sh] ERROR: %s\n' "$*" >&2
    exit 1
}

MODE=build
USE_ACTIVE="${MOIRA_USE_ACTIVE_ENV:-0}"
PY=""
TARGET_VLLM=""
PATCH_DIR="${MOIRA_PATCHES_DIR:-${ROOT}/patches}"
PATCH_DIR_FROM="MOIRA_PATCHES_DIR"
[[ -n "${MOIRA_PATCHES_DIR:-}" ]] || PATCH_DIR_FROM="the default patch directory"
VLLM_SRC=""
IMPORT_CHECK=0
CACHE_DIR="${MOIRA_CACHE_DIR:-${ROOT}/.cache}"

while [[ $# -gt 0 ]]; do
    case "$1" in
    -h | --help)
        usage
        exit 0
        ;;
    --use-active-env) USE_ACTIVE=1 ;;
    --python)
        [[ $# -ge 2 ]] || die "--python needs a path"
        PY="$2"
        USE_ACTIVE=1
        shift
        ;;
    --target-vllm)
        [[ $# -ge 2 ]] || die "--target-vllm needs a directory"
        TARGET_VLLM="$2"
        shift
        ;;
    --patches)
        [[ $# -ge 2 ]] || die "--patches needs a directory"
        PATCH_DIR="$2"
        PATCH_DIR_FROM="--patches"
        shift
        ;;
    --check) MODE=check ;;
    --fetch-sdist) MODE=fetch ;;
    --vllm-src)
        [[ $# -ge 2 ]] || die "--vllm-src needs a directory"
        VLLM_SRC="$2"
        shift
        ;;
    --import-check) IMPORT_CHECK=1 ;;
    *) die "unknown argument: $1 (see --help)" ;;
    esac
    shift
done

# A mistyped patch directory must not build "nothing to apply" as if it were the series.
# An existing series may be empty (nothing to apply).
[[ -d "${PATCH_DIR}" ]] || die "${PATCH_DIR_FROM} ${PATCH_DIR}: no such directory (a patch directory holds a 'series' file)"
[[ -f "${PATCH_DIR}/series" ]] || die "${PATCH_DIR_FROM} ${PATCH_DIR}: no 'series' file in it (a patch directory lists its patches, in order, in 'series')"
PATCH_DIR="$(cd "${PATCH_DIR}" && pwd)"
SERIES="${PATCH_DIR}/series"

# ---------------------------------------------------------------- patch helpers

# Print the patch file names of the series, in order ('#' comments and blanks ignored).
series_patches() {
    [[ -f "${SERIES}" ]] || return 0
    local line
    while IFS= read -r line || [[ -n "${line}" ]]; do
        line="${line%%#*}"
        line="$(printf '%s' "${line}" | tr -d '[:space:]')"
        [[ -n "${line}" ]] && printf '%s\n' "${line}"
    done <"${SERIES}"
}

# Patch tool: GNU patch when available, else git apply (MOIRA_PATCH_TOOL=patch|git forces one).
PATCH_TOOL="${MOIRA_PATCH_TOOL:-}"
if [[ -z "${PATCH_TOOL}" ]]; then
    if command -v patch >/dev/null 2>&1; then PATCH_TOOL="patch"; else PATCH_TOOL="git"; fi
fi
case "${PATCH_TOOL}" in
patch | git) command -v "${PATCH_TOOL}" >/dev/null 2>&1 || die "'${PATCH_TOOL}' not found: install GNU patch or git" ;;
*) die "MOIRA_PATCH_TOOL must be 'patch' or 'git', not '${PATCH_TOOL}'" ;;
esac

# git apply must not discover an enclosing repository (site-packages may live inside a
# checkout's .venv): a ceiling just above DIR stops the search.
git_apply() {
    local dir="$1"
    shift
    (cd "${dir}" && GIT_CEILING_DIRECTORIES="$(dirname "${dir}")" git apply -p1 "$@")
}

# apply_tool ROOTDIR PATCHFILE MODE   MODE: check | apply | check-reverse
# Prints the tool's output; returns its status.
apply_tool() {
    local dir="$1" file="$2" mode="$3"
    if [[ "${PATCH_TOOL}" == patch ]]; then
        local -a args=(-p1 --fuzz=0 --no-backup-if-mismatch -r - -d "${dir}" -i "${file}")
        case "${mode}" in
        check) patch --dry-run -N "${args[@]}" </dev/null ;;
        apply) patch -N "${args[@]}" </dev/null ;;
        check-reverse) patch --dry-run -R -f "${args[@]}" </dev/null ;;
        esac
    else
        case "${mode}" in
        check) git_apply "${dir}" --check -v "${file}" ;;
        apply) git_apply "${dir}" -v "${file}" ;;
        check-reverse) git_apply "${dir}" -R --check "${file}" ;;
        esac
    fi
}

# show_rejects ROOTDIR PATCHFILE: apply the patch to a scratch copy of the files it touches
# and print the rejected hunks (.rej content), so a failure shows what did not match.
show_rejects() {
    local dir="$1" file="$2" scratch f
    scratch="$(mktemp -d "${TMPDIR:-/tmp}/moira-rej.XXXXXX")"
    while IFS= read -r f; do
        if [[ -f "${dir}/${f}" ]]; then
            mkdir -p "${scratch}/$(dirname "${f}")"
            cp "${dir}/${f}" "${scratch}/${f}"
        fi
    done < <(sed -n -e 's#^--- a/\([^[:space:]]*\).*#\1#p' -e 's#^+++ b/\([^[:space:]]*\).*#\1#p' "${file}" | sort -u)
    if [[ "${PATCH_TOOL}" == patch ]]; then
        patch -p1 --fuzz=0 -N --no-backup-if-mismatch -r "${scratch}/all.rej" \
            -d "${scratch}" -i "${file}" </dev/null >/dev/null 2>&1 || true
    else
        git_apply "${scratch}" --reject "${file}" >/dev/null 2>&1 || true
    fi
    local rej
    while IFS= read -r -d '' rej; do
        if [[ -s "${rej}" ]]; then
            printf '%s\n' "----- rejected hunks of $(basename "${file}") (${rej#"${scratch}"/}) -----"
            cat "${rej}"
        fi
    done < <(find "${scratch}" -name '*.rej' -print0 | sort -z)
    rm -rf "${scratch}"
}

# The series applied by the last build is recorded in <vllm>/.moira-build/applied/ (series +
# copies of the patches). When the series changed since (a patch was edited, dropped or
# reordered), the recorded patches are reverse-applied first, so a dev environment follows
# patch edits without reinstalling vLLM. A stale record (e.g. vLLM reinstalled) is ignored.
record_dir() { printf '%s\n' "${VLLM_DIR}/.moira-build/applied"; }

series_fingerprint() { # DIR: patches listed in DIR/series with their contents
    local dir="$1" name
    [[ -f "${dir}/series" ]] || return 0
    while IFS= read -r name; do
        printf '== %s\n' "${name}"
        cat "${dir}/${name}" 2>/dev/null || true
    done < <(SERIES="${dir}/series" series_patches)
}

revert_recorded_series() {
    local dir="$1" rec names i name
    rec="$(record_dir)"
    [[ -f "${rec}/series" ]] || return 0
    if [[ "$(series_fingerprint "${rec}")" == "$(series_fingerprint "${PATCH_DIR}")" ]]; then
        return 0
    fi
    log "patch series changed since the last build: reverting the recorded series first"
    mapfile -t names < <(SERIES="${rec}/series" series_patches)
    for ((i = ${#names[@]} - 1; i >= 0; i--)); do
        name="${names[i]}"
        patch_touches_package "${rec}/${name}" || continue # tests only: never installed
        if apply_tool "${dir}" "${rec}/${name}" check-reverse >/dev/null 2>&1; then
            if [[ "${PATCH_TOOL}" == patch ]]; then
                patch -p1 -R -f --fuzz=0 --no-backup-if-mismatch -r - -d "${dir}" \
                    -i "${rec}/${name}" </dev/null >/dev/null
            else
                git_apply "${dir}" -R "${rec}/${name}" >/dev/null
            fi
            log "patch ${name} (recorded): reverted"
        else
            log "patch ${name} (recorded): not applied here, record ignored from here on"
            break
        fi
    done
    rm -rf "${rec}"
}

record_series() {
    local rec name
    rec="$(record_dir)"
    rm -rf "${rec}"
    mkdir -p "${rec}"
    [[ -f "${SERIES}" ]] || return 0
    cp "${SERIES}" "${rec}/series"
    while IFS= read -r name; do
        mkdir -p "$(dirname "${rec}/${name}")"
        cp "${PATCH_DIR}/${name}" "${rec}/${name}"
    done < <(series_patches)
}

N_APPLIED=0
N_SKIPPED=0

# created_files PATCHFILE: paths (relative to ROOTDIR) that the patch creates (--- /dev/null).
created_files() {
    awk '/^--- \/dev\/null/ { getline; sub(/^\+\+\+ b\//, ""); sub(/[ \t].*$/, ""); print }' "$1"
}

# apply_over_leftovers ROOTDIR PATCHFILE: a stock vLLM re-installed over a Moira build (pip
# --force-reinstall, a re-extracted bundle) restores vLLM's files but leaves the files that
# patches created, so such a patch neither applies nor reverses. If it applies once those
# leftovers are set aside, apply it (it recreates them); otherwise put them back. 0 = applied.
apply_over_leftovers() {
    local dir="$1" file="$2" f aside
    local -a moved=()
    aside="$(mktemp -d "${TMPDIR:-/tmp}/moira-aside.XXXXXX")"
    while IFS= read -r f; do
        if [[ -n "${f}" && -f "${dir}/${f}" ]]; then
            mkdir -p "${aside}/$(dirname "${f}")"
            mv "${dir}/${f}" "${aside}/${f}"
            moved+=("${f}")
        fi
    done < <(created_files "${file}")
    if [[ ${#moved[@]} -gt 0 ]] && apply_tool "${dir}" "${file}" check >/dev/null 2>&1 &&
        apply_tool "${dir}" "${file}" apply >/dev/null 2>&1; then
        rm -rf "${aside}"
        return 0
    fi
    for f in "${moved[@]}"; do
        mv "${aside}/${f}" "${dir}/${f}"
    done
    rm -rf "${aside}"
    return 1
}

# patch_touches_package PATCHFILE: true when the patch changes a file under vllm/ (the
# installed package); a patch of vLLM's tests/ alone is for the source tree only.
patch_touches_package() {
    grep -qE '^\+\+\+ b/vllm/' "$1"
}

# apply_series ROOTDIR  (ROOTDIR holds vllm/): idempotent.
apply_series() {
    local dir="$1" name file out
    local -a names
    mapfile -t names < <(series_patches)
    if [[ ${#names[@]} -eq 0 ]]; then
        log "patches: none (empty series at ${SERIES})"
        return 0
    fi
    for name in "${names[@]}"; do
        file="${PATCH_DIR}/${name}"
        [[ -f "${file}" ]] || die "patch listed in ${SERIES} not found: ${name}"
        if ! patch_touches_package "${file}"; then
            # An installed vLLM has no tests/ tree; --check applies these to the sdist.
            log "patch ${name}: changes vLLM's tests only, nothing to install"
            continue
        fi
        if out="$(apply_tool "${dir}" "${file}" check 2>&1)"; then
            if ! out="$(apply_tool "${dir}" "${file}" apply 2>&1)"; then
                printf '%s\n' "${out}" >&2
                die "patch ${name} passed the dry run but failed to apply"
            fi
            log "patch ${name}: applied"
            N_APPLIED=$((N_APPLIED + 1))
        elif apply_tool "${dir}" "${file}" check-reverse >/dev/null 2>&1; then
            log "patch ${name}: already applied, skipped"
            N_SKIPPED=$((N_SKIPPED + 1))
        elif apply_over_leftovers "${dir}" "${file}"; then
            log "patch ${name}: applied (over files left by an earlier build of a reinstalled vLLM)"
            N_APPLIED=$((N_APPLIED + 1))
        else
            {
                printf '%s\n' "----- ${name} does not apply to ${dir} (dry-run output) -----"
                printf '%s\n' "${out}"
                show_rejects "${dir}" "${file}"
                printf '%s\n' "----- end of ${name} -----"
            } >&2
            log "hint: if an older version of ${name} is applied here, restore stock vLLM" \
                "(pip install --force-reinstall --no-deps vllm==${VLLM_VERSION}) and re-run" >&2
            die "patch ${name} does not apply (series: ${SERIES})"
        fi
    done
}

# ---------------------------------------------------------------- check mode

SDIST_NAME="vllm-${VLLM_VERSION}.tar.gz"

fetch_sdist() {
    # Prints the sdist path on stdout.
    if [[ -n "${MOIRA_VLLM_SDIST:-}" ]]; then
        [[ -f "${MOIRA_VLLM_SDIST}" ]] || die "MOIRA_VLLM_SDIST=${MOIRA_VLLM_SDIST} not found"
        printf '%s\n' "${MOIRA_VLLM_SDIST}"
        return 0
    fi
    local dest="${CACHE_DIR}/sdist"
    if [[ ! -s "${dest}/${SDIST_NAME}" ]]; then
        local py="${PY:-python3}"
        mkdir -p "${dest}"
        log "downloading ${SDIST_NAME} into ${dest} (once)" >&2
        VLLM_VERSION_OVERRIDE="${VLLM_VERSION}" VLLM_TARGET_DEVICE=empty \
            "${py}" -m pip download --no-deps --no-binary vllm -d "${dest}" \
            "vllm==${VLLM_VERSION}" >&2 ||
            die "could not download the vLLM ${VLLM_VERSION} sdist (set MOIRA_VLLM_SDIST=FILE to use a local copy)"
        [[ -s "${dest}/${SDIST_NAME}" ]] || die "pip download did not produce ${dest}/${SDIST_NAME}"
    fi
    printf '%s\n' "${dest}/${SDIST_NAME}"
}

run_check() {
    local tmp tree
    tmp="$(mktemp -d "${TMPDIR:-/tmp}/moira-check.XXXXXX")"
    # shellcheck disable=SC2064  # expand now: tmp is local
    trap "rm -rf '${tmp}'" EXIT
    if [[ -n "${VLLM_SRC}" ]]; then
        [[ -f "${VLLM_SRC}/vllm/__init__.py" ]] || die "--vllm-src ${VLLM_SRC}: no vllm/__init__.py"
        log "check: copying ${VLLM_SRC} (without .git) to a temp dir"
        tree="${tmp}/src"
        mkdir -p "${tree}"
        tar -C "${VLLM_SRC}" --exclude=./.git -cf - . | tar -C "${tree}" --no-same-owner -xf -
    else
        local sdist
        sdist="$(fetch_sdist)"
        log "check: extracting ${sdist}"
        tar --no-same-owner -xzf "${sdist}" -C "${tmp}"
        tree="${tmp}/vllm-${VLLM_VERSION}"
        [[ -d "${tree}/vllm" ]] || die "unexpected sdist layout (no vllm-${VLLM_VERSION}/vllm)"
    fi
    check_version "${tree}/vllm"
    local -a names
    mapfile -t names < <(series_patches)
    if [[ ${#names[@]} -eq 0 ]]; then
        log "check: OK, series is empty (${SERIES}): nothing to apply"
        return 0
    fi
    local name file out i=0
    for name in "${names[@]}"; do
        i=$((i + 1))
        file="${PATCH_DIR}/${name}"
        [[ -f "${file}" ]] || die "check: patch listed in ${SERIES} not found: ${name}"
        if ! out="$(apply_tool "${tree}" "${file}" check 2>&1)"; then
            {
                printf '%s\n' "----- ${name} (#${i}) does not apply after patches 1..$((i - 1)) (dry-run output) -----"
                printf '%s\n' "${out}"
                show_rejects "${tree}" "${file}"
                printf '%s\n' "----- end of ${name} -----"
            } >&2
            die "check: patch ${name} (#${i} in series) does not apply to clean vLLM ${VLLM_VERSION}"
        fi
        apply_tool "${tree}" "${file}" apply >/dev/null 2>&1 || die "check: patch ${name} failed to apply"
        log "check: ${name}: applies"
    done
    log "check: OK, ${#names[@]} patch(es) apply in order to clean vLLM ${VLLM_VERSION}"
}

# ---------------------------------------------------------------- build mode

check_version() {
    local vdir="$1" f="$1/_version.py" v
    [[ -f "${f}" ]] || die "${vdir}: no _version.py, cannot verify vLLM ${VLLM_VERSION}"
    v="$(sed -n "s/^__version__ = version = ['\"]\([^'\"]*\)['\"].*/\1/p" "${f}" | head -n1)"
    [[ -n "${v}" ]] || v="$(sed -n "s/^__version__ *= *['\"]\([^'\"]*\)['\"].*/\1/p" "${f}" | head -n1)"
    [[ "${v}" == "${VLLM_VERSION}" ]] ||
        die "${vdir} is vLLM '${v}', need ${VLLM_VERSION}"
}

# Print the vllm package dir seen by interpreter $1 (empty if not importable). No import.
find_vllm_dir() {
    "$1" - <<'PYEOF'
import importlib.util
import os

spec = importlib.util.find_spec("vllm")
if spec is not None:
    if spec.origin and spec.origin.endswith("__init__.py"):
        print(os.path.dirname(spec.origin))
    elif spec.submodule_search_locations:
        print(list(spec.submodule_search_locations)[0])
PYEOF
}

vllm_version_of() {
    local d="$1"
    [[ -f "${d}/_version.py" ]] || return 0
    sed -n "s/^__version__ = version = ['\"]\([^'\"]*\)['\"].*/\1/p" "${d}/_version.py" | head -n1
}

pip_install_vllm() {
    local py="$1"
    log "installing vllm==${VLLM_VERSION} with ${py} (several minutes)"
    "${py}" -m pip install "vllm==${VLLM_VERSION}"
    if ! command -v nvidia-smi >/dev/null 2>&1; then
        # CUDA-built extras break 'import vllm' on CPU-only machines (see docs)
        log "no GPU: removing torchvision/torchaudio/torchcodec"
        "${py}" -m pip uninstall -y torchvision torchaudio torchcodec || true
    fi
}

resolve_target() {
    if [[ -n "${TARGET_VLLM}" ]]; then
        [[ -f "${TARGET_VLLM}/__init__.py" ]] || die "--target-vllm ${TARGET_VLLM}: no __init__.py"
        VLLM_DIR="$(cd "${TARGET_VLLM}" && pwd)"
        PY=""
        return 0
    fi
    if [[ "${USE_ACTIVE}" == 1 ]]; then
        PY="${PY:-python3}"
        command -v "${PY}" >/dev/null 2>&1 || die "interpreter not found: ${PY}"
        log "environment: active interpreter $(command -v "${PY}")"
    else
        local venv="${MOIRA_VENV:-${ROOT}/.venv}"
        if [[ ! -x "${venv}/bin/python" ]]; then
            log "creating venv ${venv}"
            python3 -m venv "${venv}"
        fi
        PY="${venv}/bin/python"
        log "environment: venv ${venv}"
    fi
    VLLM_DIR="$(find_vllm_dir "${PY}")"
    local v=""
    [[ -n "${VLLM_DIR}" ]] && v="$(vllm_version_of "${VLLM_DIR}")"
    if [[ -z "${VLLM_DIR}" ]]; then
        [[ "${MOIRA_NO_PIP:-0}" == 1 ]] && die "vllm is not importable by ${PY} and MOIRA_NO_PIP=1"
        pip_install_vllm "${PY}"
        VLLM_DIR="$(find_vllm_dir "${PY}")"
        [[ -n "${VLLM_DIR}" ]] || die "vllm still not importable by ${PY} after install"
    elif [[ "${v}" != "${VLLM_VERSION}" ]]; then
        die "${PY} sees vLLM '${v}' at ${VLLM_DIR}; Moira needs ${VLLM_VERSION} (not replacing it)"
    else
        log "found vLLM ${VLLM_VERSION} at ${VLLM_DIR}: not installing"
    fi
}

N_INSTALLED=0
N_UNCHANGED=0
N_KEPT=0

install_overlay() {
    local src="${ROOT}/vllm_moira" rel dest
    [[ -d "${src}" ]] || {
        log "overlay: no vllm_moira/ directory, nothing to install"
        return 0
    }
    while IFS= read -r -d '' f; do
        rel="${f#"${src}"/}"
        # Only v1/ mirrors vLLM's tree; the package's own top-level modules (the
        # plugin entry point) are not vLLM files.
        [[ "${rel}" == v1/* ]] || continue
        dest="${VLLM_DIR}/${rel}"
        if [[ "$(basename "${rel}")" == "__init__.py" && -e "${dest}" ]]; then
            N_KEPT=$((N_KEPT + 1))
            continue
        fi
        if [[ -f "${dest}" ]] && cmp -s "${f}" "${dest}"; then
            N_UNCHANGED=$((N_UNCHANGED + 1))
            continue
        fi
        mkdir -p "$(dirname "${dest}")"
        cp -f "${f}" "${dest}"
        log "overlay: installed vllm/${rel}"
        N_INSTALLED=$((N_INSTALLED + 1))
    done < <(find "${src}" -type d -name __pycache__ -prune -o -type f ! -name '*.pyc' -print0 | sort -z)
}

verify_overlay() {
    local src="${ROOT}/vllm_moira" rel dest bad=0
    [[ -d "${src}" ]] || return 0
    while IFS= read -r -d '' f; do
        rel="${f#"${src}"/}"
        [[ "${rel}" == v1/* && "$(basename "${rel}")" != "__init__.py" ]] || continue
        dest="${VLLM_DIR}/${rel}"
        if ! cmp -s "${f}" "${dest}"; then
            printf '[build.sh] verify: vllm/%s differs from the overlay\n' "${rel}" >&2
            bad=1
        fi
    done < <(find "${src}" -type d -name __pycache__ -prune -o -type f ! -name '*.pyc' -print0)
    [[ ${bad} == 0 ]] || die "verify: overlay not installed correctly into ${VLLM_DIR}"
    if [[ -f "${src}/v1/attention/backends/moira.py" ]]; then
        [[ -f "${VLLM_DIR}/v1/attention/backends/moira.py" ]] ||
            die "verify: ${VLLM_DIR}/v1/attention/backends/moira.py missing"
        log "verify: vllm/v1/attention/backends/moira.py present"
    fi
}

run_build() {
    resolve_target
    check_version "${VLLM_DIR}"
    log "target: ${VLLM_DIR} (vLLM ${VLLM_VERSION})"
    revert_recorded_series "$(dirname "${VLLM_DIR}")"
    apply_series "$(dirname "${VLLM_DIR}")"
    record_series
    install_overlay
    verify_overlay
    if [[ "${IMPORT_CHECK}" == 1 ]]; then
        [[ -n "${PY}" ]] || die "--import-check needs an interpreter (not with --target-vllm)"
        "${PY}" -c 'import vllm.v1.attention.backends.moira as m; print("[build.sh] import OK:", m.__file__)'
    fi
    log "summary: patches applied ${N_APPLIED}, already applied ${N_SKIPPED};" \
        "overlay files installed ${N_INSTALLED}, unchanged ${N_UNCHANGED}," \
        "existing __init__.py kept ${N_KEPT}"
    if [[ $((N_APPLIED + N_INSTALLED)) -eq 0 ]]; then
        log "no changes: ${VLLM_DIR} is already the Moira build"
    fi
    log "done"
}

case "${MODE}" in
check) run_check ;;
fetch) fetch_sdist ;;
build) run_build ;;
esac
