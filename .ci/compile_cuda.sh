#!/usr/bin/env bash
# Compile every .cu and .cpp under csrc/cuda with nvcc (no GPU needed), so CUDA code cannot
# rot unseen on a CPU-only CI machine. Object files go to a temporary directory; nothing is
# linked. Flags mirror what torch.utils.cpp_extension passes for a CUDAExtension (C++17, the
# __CUDA_NO_HALF*_ macros), for sm_80 and sm_90.
#
#   bash .ci/compile_cuda.sh          # exits 0 with a message when nvcc is absent
#   NVCC=/path/to/nvcc bash .ci/compile_cuda.sh
#   RINGDP_CUDA_ARCHS="80 90 100" bash .ci/compile_cuda.sh
set -euo pipefail
cd "$(dirname "$0")/.."

NVCC="${NVCC:-}"
if [ -z "$NVCC" ]; then
  if command -v nvcc >/dev/null 2>&1; then
    NVCC="$(command -v nvcc)"
  elif [ -n "${CUDA_HOME:-}" ] && [ -x "$CUDA_HOME/bin/nvcc" ]; then
    NVCC="$CUDA_HOME/bin/nvcc"
  elif [ -x /usr/local/cuda/bin/nvcc ]; then
    NVCC=/usr/local/cuda/bin/nvcc
  fi
fi
if [ -z "$NVCC" ]; then
  echo "compile_cuda: nvcc not found (PATH, \$CUDA_HOME, /usr/local/cuda): skipping the CUDA compile check"
  exit 0
fi

ARCHS="${RINGDP_CUDA_ARCHS:-80 90}"
GENCODE=()
for a in $ARCHS; do GENCODE+=("-gencode" "arch=compute_${a},code=sm_${a}"); done
FLAGS=(-std=c++17 -O2 -Icsrc -Xcompiler -Wall -Xcompiler -Werror=return-type
       -D__CUDA_NO_HALF_OPERATORS__ -D__CUDA_NO_HALF_CONVERSIONS__
       -D__CUDA_NO_BFLOAT16_CONVERSIONS__ -D__CUDA_NO_HALF2_OPERATORS__)

OUT="$(mktemp -d)"
trap 'rm -rf "$OUT"' EXIT
echo "compile_cuda: $("$NVCC" --version | tail -n 1) ; archs: $ARCHS"

mapfile -t SOURCES < <(find csrc/cuda -type f \( -name '*.cu' -o -name '*.cpp' \) | sort)
if [ "${#SOURCES[@]}" -eq 0 ]; then
  echo "compile_cuda: no sources under csrc/cuda"
  exit 1
fi

# No torch headers may appear in these files: CI compiles them without torch.
if grep -nE '#include *[<"](torch|ATen|c10)/' "${SOURCES[@]}" csrc/cuda/*.h csrc/cuda/*.cuh 2>/dev/null; then
  echo "compile_cuda: torch headers are not allowed under csrc/cuda (see above)"
  exit 1
fi

fail=0
for src in "${SOURCES[@]}"; do
  obj="$OUT/$(echo "$src" | tr '/' '_').o"
  start=$(date +%s)
  if [[ "$src" == *.cu ]]; then
    cmd=("$NVCC" "${FLAGS[@]}" "${GENCODE[@]}" -c "$src" -o "$obj")
  else
    cmd=("$NVCC" "${FLAGS[@]}" -c "$src" -o "$obj")  # host code: no device architectures
  fi
  if "${cmd[@]}"; then
    echo "compile_cuda: ok   $src ($(( $(date +%s) - start )) s)"
  else
    echo "compile_cuda: FAIL $src"
    fail=1
  fi
done
if [ "$fail" -ne 0 ]; then
  echo "compile_cuda: FAILED"
  exit 1
fi
echo "compile_cuda: all ${#SOURCES[@]} CUDA sources compile"
