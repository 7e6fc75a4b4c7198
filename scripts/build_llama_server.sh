#!/usr/bin/env bash
# Builds llama.cpp's `llama-server` for the benchmarks' peer (bench/serve/ --llama-server).
#
# Benchmark-only: no test and no install step needs it. Source: the llama.cpp tree vendored in
# the `llama-cpp-python==0.3.36` sdist on PyPI (the one registry this project's machines reach).
# Needs cmake, ninja and a C++ compiler; about 20 minutes on 2 cores. Prints the binary's path.
#
# CPU features are chosen here, not by GGML_NATIVE: a native build crashes with a general
# protection fault at model load on Intel machines with AMX. AVX2 always, AVX-512 when this
# CPU has it (a probe of /proc/cpuinfo, printed), AMX never. The flags are stamped beside the
# build; a build made with other flags (another machine's) is rebuilt.
#
# Usage: scripts/build_llama_server.sh [BUILD_DIR]   (default: <repo>/.tools/llama.cpp)
set -euo pipefail

readonly VERSION="0.3.36"
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build_root="${1:-${repo_root}/.tools/llama.cpp}"
binary="${build_root}/build/bin/llama-server"

avx512=OFF
grep -qw avx512f /proc/cpuinfo 2>/dev/null && avx512=ON
cpu_flags=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
    "-DGGML_AVX512=${avx512}" -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
stamp="${build_root}/build/cpu_flags"
echo "build_llama_server.sh: CPU flags ${cpu_flags[*]}" >&2

if [[ -x "${binary}" && -f "${stamp}" && "$(cat "${stamp}")" == "${cpu_flags[*]}" ]]; then
    echo "${binary}"
    exit 0
fi
for tool in cmake ninja c++; do
    command -v "${tool}" >/dev/null || { echo "build_llama_server.sh: ${tool} not found" >&2; exit 1; }
done

mkdir -p "${build_root}"
[[ -f "${build_root}/../.gitignore" ]] || echo '*' > "${build_root}/../.gitignore"
src="${build_root}/src"
if [[ ! -f "${src}/CMakeLists.txt" ]]; then
    work_dir="$(mktemp -d)"
    trap 'rm -rf "${work_dir}"' EXIT
    python3 -m pip download --quiet --no-deps --no-binary :all: \
        "llama-cpp-python==${VERSION}" -d "${work_dir}"
    tar -xzf "${work_dir}"/llama_cpp_python-*.tar.gz -C "${work_dir}"
    rm -rf "${src}"
    mv "${work_dir}/llama_cpp_python-${VERSION}/vendor/llama.cpp" "${src}"
fi

cmake -S "${src}" -B "${build_root}/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_SERVER=ON "${cpu_flags[@]}" >&2
cmake --build "${build_root}/build" --target llama-server -j "$(nproc)" >&2
echo "${cpu_flags[*]}" > "${stamp}"
echo "${binary}"
