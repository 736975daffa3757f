// Python bindings of the native extension: host-side codec helpers and the
// XLA FFI handler capsules. Each source file registers its own functions.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "cpu_kernels.h"

namespace py = pybind11;

namespace {

template <typename Handler>
py::capsule FfiCapsule(Handler* handler) {
  return py::capsule(reinterpret_cast<void*>(handler));
}

}  // namespace

PYBIND11_MODULE(_qmoe_ext, m) {
  m.doc() = "qmoe_jax native extension: dictionary encoder and XLA FFI handlers";
#ifdef QMOE_WITH_CUDA
  m.attr("with_cuda") = true;
#else
  m.attr("with_cuda") = false;
#endif
  m.def(
      "registrations",
      [] {
        py::dict cpu;
        cpu["qmoe_matmul"] = FfiCapsule(QmoeMatmulCpu);
        cpu["qmoe_matmul_t"] = FfiCapsule(QmoeMatmulTransposedCpu);
        cpu["qmoe_dequantize"] = FfiCapsule(QmoeDequantizeCpu);
        py::dict platforms;
        platforms["cpu"] = cpu;
        return platforms;
      },
      "FFI handler capsules by platform, then target name.");
  m.def("cpu_isas", &qmoe::cpu::SupportedIsas,
        "Instruction sets the CPU kernels can run here, fastest first.");
}
