# Sourced by the CI scripts that configure the extension with CMake themselves
# (.ci/cuda_build_check, .ci/asan_fuzz). Sets `python` (the interpreter CMake
# builds for) and `generator` (Ninja where available), and installs what is
# missing: jax (CMake reads the XLA FFI headers' location from it), pybind11,
# cmake, and the extra modules a script names as `module requirement` pairs:
#   source .ci/build_tools.sh pytest "pytest>=8"
python="$(command -v python3 || command -v python)"
_imports="jax, pybind11"
_requirements=("jax>=0.10.2" "pybind11>=2.12")
while [ "$#" -ge 2 ]; do
  _imports+=", $1"
  _requirements+=("$2")
  shift 2
done
if ! "$python" -c "import $_imports" 2> /dev/null; then
  "$python" -m pip install --quiet "${_requirements[@]}"
fi
command -v cmake > /dev/null || "$python" -m pip install --quiet "cmake>=3.18"
generator=()
if command -v ninja > /dev/null || "$python" -c "import ninja" 2> /dev/null; then
  generator=(-G Ninja)
  command -v ninja > /dev/null || export PATH="$("$python" -c 'import ninja, os; print(ninja.BIN_DIR)'):$PATH"
fi
unset _imports _requirements
