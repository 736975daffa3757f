// Python bindings of the native extension: host-side codec helpers and the
// XLA FFI handler capsules. Each source file registers its own functions.
#include <pybind11/pybind11.h>

#include "cpu_kernels.h"
#include "encoder.h"

namespace py = pybind11;

PYBIND11_MODULE(_qmoe_ext, m) {
  m.doc() = "qmoe_jax native extension: dictionary encoder and XLA FFI handlers";
#ifdef QMOE_WITH_CUDA
  m.attr("with_cuda") = true;
#else
  m.attr("with_cuda") = false;
#endif
  qmoe::RegisterEncoder(m);
  qmoe::cpu::RegisterCpuKernels(m);
}
