// CUDA handlers of the qmoe_jax FFI targets (contract in cpu_kernels.h, CUDA
// specifics in cuda_kernels.h): operand checks on the host, optional device
// validation, then the kernels on XLA's stream.
#include "cuda_kernels.h"

#include <cuda_runtime.h>

#include <string>

#include "cpu_operands.h"
#include "cuda_launch.h"
#include "cuda_operands.h"
#include "cuda_validate.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace qmoe::cuda {
namespace {

using Dims = ffi::Span<const int64_t>;
using cpu::CheckDenseArgs;
using cpu::CheckDequantizeResult;
using cpu::ShapeString;

constexpr const char* kMatmul = "qmoe_matmul";
constexpr const char* kMatmulTransposed = "qmoe_matmul_t";
constexpr const char* kDequantize = "qmoe_dequantize";

ffi::Error CudaFailure(const char* op, const char* what, cudaError_t status) {
  return ffi::Error::Internal(std::string(op) + ": " + what + " failed: " +
                              cudaGetErrorName(status) + " (" + cudaGetErrorString(status) + ")");
}

CompressedView ViewOf(ffi::Buffer<ffi::U32> masks, ffi::Buffer<ffi::U16> codes,
                      ffi::Buffer<ffi::S32> row_offsets, ffi::Buffer<ffi::BF16> minmax,
                      const Layout& layout) {
  return {reinterpret_cast<const uint2*>(masks.typed_data()),
          codes.typed_data(),
          row_offsets.typed_data(),
          minmax.typed_data(),
          layout.n_codes,
          static_cast<int32_t>(layout.rows),
          static_cast<int32_t>(layout.cols),
          layout.batch};
}

// Runs the device validation when QMOE_CUDA_VALIDATE=1.
ffi::Error ValidateIfRequested(const char* op, const CompressedView& w, const Layout& layout,
                               ffi::ScratchAllocator& scratch, int device, cudaStream_t stream) {
  bool requested = false;
  if (auto error = ValidationRequested(op, &requested); error.failure()) return error;
  if (!requested) return ffi::Error::Success();
  return ValidateOnDevice(op, w, layout, scratch, device, stream);
}

ffi::Error MatmulImpl(cudaStream_t stream, int32_t device, ffi::ScratchAllocator scratch,
                      ffi::Buffer<ffi::U32> masks, ffi::Buffer<ffi::U8> slots,
                      ffi::Buffer<ffi::U32> words, ffi::Buffer<ffi::U16> codes,
                      ffi::Buffer<ffi::S32> row_offsets, ffi::Buffer<ffi::BF16> minmax,
                      ffi::AnyBuffer x, ffi::Buffer<ffi::S32> counts,
                      ffi::Result<ffi::AnyBuffer> y) {
  const Dims y_dims = y->dimensions();
  const Dims x_dims = x.dimensions();
  if (auto error = CheckDenseArgs(kMatmul, {"x", x.element_type(), x_dims, "cols"},
                                  {"y", y->element_type(), y_dims, "rows"});
      error.failure()) {
    return error;
  }
  const DenseOperand dense{"x", x_dims, /*width_is_rows=*/false, counts.dimensions()};
  Layout layout;
  if (auto error = CheckOperands(kMatmul, masks, slots, words, codes, row_offsets, minmax,
                                 Dims(y_dims.begin(), y_dims.size() - 2), y_dims[y_dims.size() - 2],
                                 x_dims.back(), &dense, &layout);
      error.failure()) {
    return error;
  }
  if (y_dims.back() != layout.rows) {
    return ffi::Error::InvalidArgument(std::string(kMatmul) + ": y must have " +
                                       std::to_string(layout.rows) +
                                       " columns (rows of minmax); got " + ShapeString(y_dims));
  }
  const CompressedView w = ViewOf(masks, codes, row_offsets, minmax, layout);
  if (auto error = ValidateIfRequested(kMatmul, w, layout, scratch, device, stream);
      error.failure()) {
    return error;
  }
  if (y->element_count() == 0) return ffi::Error::Success();
  const DenseView x_y{x.untyped_data(),
                      y->untyped_data(),
                      x.element_type() == ffi::DataType::BF16,
                      layout.tokens,
                      {counts.typed_data(), layout.entry_tokens}};
  if (cudaError_t status = LaunchMatmul(w, x_y, device, stream); status != cudaSuccess) {
    return CudaFailure(kMatmul, "launching the matmul kernel", status);
  }
  return ffi::Error::Success();
}

ffi::Error MatmulTransposedImpl(cudaStream_t stream, int32_t device, ffi::ScratchAllocator scratch,
                                ffi::Buffer<ffi::U32> masks, ffi::Buffer<ffi::U8> slots,
                                ffi::Buffer<ffi::U32> words, ffi::Buffer<ffi::U16> codes,
                                ffi::Buffer<ffi::S32> row_offsets, ffi::Buffer<ffi::BF16> minmax,
                                ffi::AnyBuffer g, ffi::Buffer<ffi::S32> counts,
                                ffi::Result<ffi::AnyBuffer> dx) {
  const char* op = kMatmulTransposed;
  const Dims dx_dims = dx->dimensions();
  const Dims g_dims = g.dimensions();
  if (auto error = CheckDenseArgs(op, {"g", g.element_type(), g_dims, "rows"},
                                  {"dx", dx->element_type(), dx_dims, "cols"});
      error.failure()) {
    return error;
  }
  const DenseOperand dense{"g", g_dims, /*width_is_rows=*/true, counts.dimensions()};
  Layout layout;
  if (auto error = CheckOperands(op, masks, slots, words, codes, row_offsets, minmax,
                                 Dims(dx_dims.begin(), dx_dims.size() - 2),
                                 dx_dims[dx_dims.size() - 2], dx_dims.back(), &dense, &layout);
      error.failure()) {
    return error;
  }
  const CompressedView w = ViewOf(masks, codes, row_offsets, minmax, layout);
  if (auto error = ValidateIfRequested(op, w, layout, scratch, device, stream); error.failure()) {
    return error;
  }
  const int64_t count = dx->element_count();
  if (count == 0) return ffi::Error::Success();
  const bool bf16 = g.element_type() == ffi::DataType::BF16;
  float* sums = static_cast<float*>(dx->untyped_data());
  if (bf16) {
    const std::optional<void*> memory = scratch.Allocate(count * sizeof(float), alignof(float4));
    if (!memory.has_value()) {
      return ffi::Error::Internal(std::string(op) + ": could not allocate " +
                                  std::to_string(count * sizeof(float)) +
                                  " bytes of float32 sums for the bf16 gradient");
    }
    sums = static_cast<float*>(*memory);
  }
  cudaError_t status = cudaMemsetAsync(sums, 0, count * sizeof(float), stream);
  if (status == cudaSuccess && layout.rows > 0) {
    const DenseView g_view{
        g.untyped_data(), nullptr, bf16, layout.tokens, {counts.typed_data(), layout.entry_tokens}};
    status = LaunchMatmulTransposed(w, g_view, sums, device, stream);
  }
  if (status == cudaSuccess && bf16) {
    status = LaunchRoundToBf16(sums, static_cast<uint16_t*>(dx->untyped_data()), count, device,
                               stream);
  }
  if (status != cudaSuccess) return CudaFailure(op, "launching the matmul_t kernels", status);
  return ffi::Error::Success();
}

ffi::Error DequantizeImpl(cudaStream_t stream, int32_t device, ffi::ScratchAllocator scratch,
                          ffi::Buffer<ffi::U32> masks, ffi::Buffer<ffi::U8> slots,
                          ffi::Buffer<ffi::U32> words, ffi::Buffer<ffi::U16> codes,
                          ffi::Buffer<ffi::S32> row_offsets, ffi::Buffer<ffi::BF16> minmax,
                          int64_t cols, ffi::Result<ffi::Buffer<ffi::BF16>> weights) {
  const Dims dims = weights->dimensions();
  if (auto error = CheckDequantizeResult(kDequantize, dims, cols); error.failure()) return error;
  Layout layout;
  if (auto error = CheckOperands(kDequantize, masks, slots, words, codes, row_offsets, minmax,
                                 Dims(dims.begin(), dims.size() - 2), /*tokens=*/0, cols,
                                 /*dense=*/nullptr, &layout);
      error.failure()) {
    return error;
  }
  if (dims[dims.size() - 2] != layout.rows) {
    return ffi::Error::InvalidArgument(std::string(kDequantize) + ": the result must have " +
                                       std::to_string(layout.rows) +
                                       " rows (rows of minmax); got " + ShapeString(dims));
  }
  const CompressedView w = ViewOf(masks, codes, row_offsets, minmax, layout);
  if (auto error = ValidateIfRequested(kDequantize, w, layout, scratch, device, stream);
      error.failure()) {
    return error;
  }
  const int64_t count = weights->element_count();
  if (count == 0) return ffi::Error::Success();
  cudaError_t status = cudaMemsetAsync(weights->typed_data(), 0, count * sizeof(uint16_t), stream);
  if (status == cudaSuccess) status = LaunchDequantize(w, weights->typed_data(), device, stream);
  if (status != cudaSuccess) {
    return CudaFailure(kDequantize, "launching the dequantize kernel", status);
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace qmoe::cuda

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    QmoeMatmulCuda, qmoe::cuda::MatmulImpl,
    xla::ffi::Ffi::Bind()
        .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()  // XLA's stream for this call
        .Ctx<xla::ffi::DeviceOrdinal>()                 // the device, for its multiprocessor count
        .Ctx<xla::ffi::ScratchAllocator>()              // used only by QMOE_CUDA_VALIDATE=1
        .Arg<xla::ffi::Buffer<xla::ffi::U32>>()         // masks u32[65536, 2]
        .Arg<xla::ffi::Buffer<xla::ffi::U8>>()          // slots u8[65536, 16] (shape checked only)
        .Arg<xla::ffi::Buffer<xla::ffi::U32>>()         // words u32[65536] (shape checked only)
        .Arg<xla::ffi::Buffer<xla::ffi::U16>>()         // codes u16[B..., n_codes]
        .Arg<xla::ffi::Buffer<xla::ffi::S32>>()         // row_offsets i32[B..., rows + 1]
        .Arg<xla::ffi::Buffer<xla::ffi::BF16>>()        // minmax bf16[B..., rows, 2]
        .Arg<xla::ffi::AnyBuffer>()                     // x f32|bf16[B..., N, cols]
        .Arg<xla::ffi::Buffer<xla::ffi::S32>>()         // counts i32[B...], tokens in use
        .Ret<xla::ffi::AnyBuffer>(),                    // y [B..., N, rows]
    {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    QmoeMatmulTransposedCuda, qmoe::cuda::MatmulTransposedImpl,
    xla::ffi::Ffi::Bind()
        .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()  // XLA's stream for this call
        .Ctx<xla::ffi::DeviceOrdinal>()                 // the device, for its multiprocessor count
        .Ctx<xla::ffi::ScratchAllocator>()              // f32 sums for bf16 dx; validation
        .Arg<xla::ffi::Buffer<xla::ffi::U32>>()         // masks u32[65536, 2]
        .Arg<xla::ffi::Buffer<xla::ffi::U8>>()          // slots u8[65536, 16] (shape checked only)
        .Arg<xla::ffi::Buffer<xla::ffi::U32>>()         // words u32[65536] (shape checked only)
        .Arg<xla::ffi::Buffer<xla::ffi::U16>>()         // codes u16[B..., n_codes]
        .Arg<xla::ffi::Buffer<xla::ffi::S32>>()         // row_offsets i32[B..., rows + 1]
        .Arg<xla::ffi::Buffer<xla::ffi::BF16>>()        // minmax bf16[B..., rows, 2]
        .Arg<xla::ffi::AnyBuffer>()                     // g f32|bf16[B..., N, rows]
        .Arg<xla::ffi::Buffer<xla::ffi::S32>>()         // counts i32[B...], tokens in use
        .Ret<xla::ffi::AnyBuffer>());                   // dx [B..., N, cols]

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    QmoeDequantizeCuda, qmoe::cuda::DequantizeImpl,
    xla::ffi::Ffi::Bind()
        .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()  // XLA's stream for this call
        .Ctx<xla::ffi::DeviceOrdinal>()                 // the device, for its multiprocessor count
        .Ctx<xla::ffi::ScratchAllocator>()              // used only by QMOE_CUDA_VALIDATE=1
        .Arg<xla::ffi::Buffer<xla::ffi::U32>>()         // masks u32[65536, 2]
        .Arg<xla::ffi::Buffer<xla::ffi::U8>>()          // slots u8[65536, 16] (shape checked only)
        .Arg<xla::ffi::Buffer<xla::ffi::U32>>()         // words u32[65536] (shape checked only)
        .Arg<xla::ffi::Buffer<xla::ffi::U16>>()         // codes u16[B..., n_codes]
        .Arg<xla::ffi::Buffer<xla::ffi::S32>>()         // row_offsets i32[B..., rows + 1]
        .Arg<xla::ffi::Buffer<xla::ffi::BF16>>()        // minmax bf16[B..., rows, 2]
        .Attr<int64_t>("cols")                          // columns of W
        .Ret<xla::ffi::Buffer<xla::ffi::BF16>>(),       // w bf16[B..., rows, cols]
    {xla::ffi::Traits::kCmdBufferCompatible});
