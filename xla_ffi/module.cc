// Python bindings of the native extension: host-side codec helpers and the
// XLA FFI handler capsules. Each source file registers its own functions.
#include <pybind11/pybind11.h>

#include "cpu_cholesky.h"
#include "cpu_dense.h"
#include "cpu_gptq.h"
#include "cpu_kernels.h"
#include "cpu_routed.h"
#include "encoder.h"
#ifdef QMOE_WITH_CUDA
#include "cuda_kernels.h"
#endif

namespace py = pybind11;

namespace {

py::capsule Capsule(XLA_FFI_Handler* handler) {
  return py::capsule(reinterpret_cast<void*>(handler));
}

// {platform: {target: handler capsule}}: "cpu" always, "CUDA" when built with CUDA.
py::dict Registrations() {
  py::dict platforms;
  py::dict cpu;
  cpu["qmoe_matmul"] = Capsule(QmoeMatmulCpu);
  cpu["qmoe_matmul_t"] = Capsule(QmoeMatmulTransposedCpu);
  cpu["qmoe_dequantize"] = Capsule(QmoeDequantizeCpu);
  cpu["qmoe_matmul_routed"] = Capsule(QmoeMatmulRoutedCpu);
  cpu["qmoe_matmul_routed_t"] = Capsule(QmoeMatmulRoutedTransposedCpu);
  cpu["qmoe_gptq_block"] = Capsule(QmoeGptqBlockCpu);
  cpu["qmoe_cholesky_base"] = Capsule(QmoeCholeskyBaseCpu);
  cpu["qmoe_dense_matmul"] = Capsule(QmoeDenseMatmulCpu);
  cpu["qmoe_dense_matmul_t"] = Capsule(QmoeDenseMatmulTransposedCpu);
  platforms["cpu"] = cpu;
#ifdef QMOE_WITH_CUDA
  py::dict cuda;
  cuda["qmoe_matmul"] = Capsule(QmoeMatmulCuda);
  cuda["qmoe_matmul_t"] = Capsule(QmoeMatmulTransposedCuda);
  cuda["qmoe_dequantize"] = Capsule(QmoeDequantizeCuda);
  platforms["CUDA"] = cuda;
#endif
  return platforms;
}

}  // namespace

PYBIND11_MODULE(qmoe_jax_ext, m) {
  m.doc() = "qmoe_jax native extension: dictionary encoder and XLA FFI handlers";
#ifdef QMOE_WITH_CUDA
  m.attr("with_cuda") = true;
#else
  m.attr("with_cuda") = false;
#endif
  qmoe::RegisterEncoder(m);
  qmoe::cpu::RegisterCpuKernels(m);
  m.def("registrations", &Registrations, "XLA FFI handler capsules by platform, then target name.");
}
