#!/usr/bin/env bash
# The GPU check of the CUDA kernels (issue #5), unattended, in under about 8
# minutes on one H100/H200-class GPU:
#   1. builds the extension with QMOE_CUDA=ON in-tree (cmake + ninja + nvcc;
#      the module lands in the repository root, beside qmoe_jax/);
#   2. runs tests/kernels/test_ops_cuda.py on the GPU, then the CPU op and native
#      GPTQ tests (tests/kernels/test_ops.py, tests/kernels/test_ops_fuzz.py,
#      tests/quant/test_quant_gptq_native.py, tests/quant/test_quant_linalg_native.py)
#      with JAX_PLATFORMS=cpu, under every instruction set the host's CPU
#      has (the op tests run each one; the GPTQ tests compare each one
#      with portable): on a host with AVX-512 this is where the AVX-512 CPU
#      kernels run on hardware (CI's .ci/asan_fuzz runs their logic through
#      scalar stand-ins of the intrinsics only);
#   3. times the CPU matvec under each of those instruction sets, taking
#      turns (benchmarks/matvec_scaling.py --isas): which kernel the host's
#      CPU should pick;
#   4. runs benchmarks/kernels_gpu.py (table on stdout, JSON to $OUT or
#      benchmarks/results/, as step 3's).
# Assumes, and installs nothing (the GPU machine has no network): python3 with
# jax + jaxlib + the CUDA plugin, numpy, ml_dtypes, pybind11, pytest and
# hypothesis; cmake, ninja and nvcc (on PATH, or CUDACXX, or
# /usr/local/cuda/bin). qmoe_jax itself is not pip-installed: its runtime
# dependencies beyond those (flax, tensorstore, ...) are not imported here.
#
#   bash benchmarks/gpu_check.sh          # from anywhere; exit status 0 = all passed
# Logs and the JSON go to $OUT when set (the device tool's folder), else
# benchmarks/results/. Each phase has a time limit, and all of them together
# stay within QMOE_GPU_CHECK_BUDGET_S (default 470 s).
set -uo pipefail
cd "$(dirname "$0")/.."
started=$SECONDS
budget="${QMOE_GPU_CHECK_BUDGET_S:-470}"  # seconds for the whole check
out="${OUT:-benchmarks/results}"
mkdir -p "$out"
python="$(command -v python3 || command -v python)"
status=0

phase() { echo; echo "== [$((SECONDS - started)) s] $*"; }
# run_logged NAME LIMIT_S COMMAND...: runs COMMAND for at most LIMIT_S seconds and
# never past the whole check's budget, tees to $out/NAME.log, records failure.
run_logged() {
  local name=$1 limit=$2
  shift 2
  local left=$((budget - (SECONDS - started)))
  if [ "$left" -lt 15 ]; then
    echo "gpu_check: $name skipped, the ${budget} s budget is spent"
    status=1
    return 1
  fi
  [ "$left" -lt "$limit" ] && limit=$left
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$out/$name.log"
  local code=${PIPESTATUS[0]}
  if [ "$code" -ne 0 ]; then
    echo "gpu_check: $name failed with exit status $code (124: timed out after $limit s)"
    status=1
  fi
  return "$code"
}

phase "machine"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader || true
"$python" -c "import jax; print('jax', jax.__version__, jax.devices())" || { echo "gpu_check: jax does not start"; exit 1; }

phase "build (QMOE_CUDA=ON, sm_80 + sm_90)"
nvcc="${CUDACXX:-$(command -v nvcc || true)}"
[ -z "$nvcc" ] && [ -x /usr/local/cuda/bin/nvcc ] && nvcc=/usr/local/cuda/bin/nvcc
if [ -z "$nvcc" ]; then
  echo "gpu_check: nvcc not found (set CUDACXX)"
  exit 1
fi
"$nvcc" --version | tail -n 1
run_logged build 240 bash -c "cmake -S . -B build/gpu-check -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DQMOE_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES='80;90' -DCMAKE_CUDA_COMPILER='$nvcc' \
  -DPython_EXECUTABLE='$python' && cmake --build build/gpu-check --parallel" || exit 1

export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the root: qmoe_jax/ and the built qmoe_jax_ext
export PYTHONUNBUFFERED=1
"$python" -c "from qmoe_jax.kernels import ops; assert ops.has_cuda_kernels(); print('CUDA handlers registered')" \
  || { echo "gpu_check: the built extension has no CUDA handlers"; exit 1; }

phase "tests on the GPU: tests/kernels/test_ops_cuda.py"
XLA_PYTHON_CLIENT_PREALLOCATE=false run_logged tests_cuda 210 \
  "$python" -m pytest -q -p no:cacheprovider -m "" -rs tests/kernels/test_ops_cuda.py

phase "CPU op and native GPTQ tests (JAX_PLATFORMS=cpu), every instruction set of this CPU"
grep -m1 "model name" /proc/cpuinfo || true
JAX_PLATFORMS=cpu "$python" -c "from qmoe_jax.kernels import ops; print('CPU kernels:', ops.cpu_isas())" || status=1
JAX_PLATFORMS=cpu run_logged tests_cpu 180 \
  "$python" -m pytest -q -p no:cacheprovider -m "" tests/kernels/test_ops.py tests/kernels/test_ops_fuzz.py \
  tests/quant/test_quant_gptq_native.py tests/quant/test_quant_linalg_native.py

phase "CPU matvec per instruction set (benchmarks/matvec_scaling.py --isas): is AVX-512 or AVX2 faster here?"
JAX_PLATFORMS=cpu run_logged matvec_isas 60 "$python" benchmarks/matvec_scaling.py --isas --calls 60 \
  --output "$out/matvec_scaling.json"

phase "benchmark: benchmarks/kernels_gpu.py"
run_logged kernels_gpu 200 "$python" benchmarks/kernels_gpu.py --output "$out/kernels_gpu.json"

phase "done in $((SECONDS - started)) s, status $status (logs and JSON in $out)"
exit "$status"
