#include "cuda_validate.h"

#include <cstdlib>
#include <cstring>
#include <string>

#include "cpu_operands.h"

namespace ffi = xla::ffi;

namespace qmoe::cuda {
namespace {

std::string Prefix(const char* op) { return std::string(op) + ": "; }

using cpu::OfBatch;

ffi::Error CudaFailure(const char* op, const char* what, cudaError_t status) {
  return ffi::Error::Internal(Prefix(op) + what + " failed: " + cudaGetErrorName(status) + " (" +
                              cudaGetErrorString(status) + ")");
}

// Copies `bytes` from the device to `host` and waits for the stream.
ffi::Error Fetch(const char* op, void* host, const void* device_data, size_t bytes,
                 cudaStream_t stream) {
  cudaError_t status = cudaMemcpyAsync(host, device_data, bytes, cudaMemcpyDeviceToHost, stream);
  if (status == cudaSuccess) status = cudaStreamSynchronize(stream);
  if (status != cudaSuccess) return CudaFailure(op, "reading the validation result", status);
  return ffi::Error::Success();
}

ffi::Error OffsetsError(const char* op, const CompressedView& w, const Layout& layout,
                        unsigned long long key, cudaStream_t stream) {
  const int64_t matrix = static_cast<int64_t>(key >> 33);
  const unsigned kind = static_cast<unsigned>(key >> 31) & 3u;
  const int32_t entry = static_cast<int32_t>(key & 0x7fffffffu);
  const int32_t* offsets = w.row_offsets + matrix * (layout.rows + 1);
  const std::string where = OfBatch(layout.result_batch, matrix);
  int32_t values[2] = {};
  const int count = kind == kOffsetsDecrease ? 2 : 1;
  if (auto error = Fetch(op, values, offsets + entry, count * sizeof(int32_t), stream);
      error.failure()) {
    return error;
  }
  if (kind == kOffsetsStart) {
    return ffi::Error::InvalidArgument(Prefix(op) + "row_offsets" + where + " start at " +
                                       std::to_string(values[0]) +
                                       ", not 0; the compressed matrix is corrupt");
  }
  if (kind == kOffsetsDecrease) {
    return ffi::Error::InvalidArgument(Prefix(op) + "row_offsets" + where + " decrease at row " +
                                       std::to_string(entry) + " (" + std::to_string(values[0]) +
                                       " then " + std::to_string(values[1]) +
                                       "); the compressed matrix is corrupt");
  }
  return ffi::Error::InvalidArgument(
      Prefix(op) + "row_offsets" + where + " end at codeword " + std::to_string(values[0]) +
      ", past the " + std::to_string(layout.n_codes) +
      " codewords of codes; the compressed matrix is corrupt or truncated");
}

ffi::Error BadRowError(const char* op, const CompressedView& w, const Layout& layout,
                       unsigned long long key, long long* weights_on_device, cudaStream_t stream) {
  const int64_t b = static_cast<int64_t>(key >> 32);
  const int32_t row = static_cast<int32_t>(key & 0xffffffffu);
  if (cudaError_t status = LaunchCountRowWeights(w, b, row, weights_on_device, stream);
      status != cudaSuccess) {
    return CudaFailure(op, "launching the validation kernel", status);
  }
  long long weights = 0;
  if (auto error = Fetch(op, &weights, weights_on_device, sizeof weights, stream);
      error.failure()) {
    return error;
  }
  const int64_t padded_cols = layout.cols + (layout.cols & 1);
  const std::string expected = std::to_string(padded_cols) +
                               " (cols = " + std::to_string(layout.cols) +
                               (layout.cols % 2 ? ", padded to even)" : ")");
  return ffi::Error::InvalidArgument(
      Prefix(op) + "row " + std::to_string(row) + OfBatch(layout.result_batch, b * layout.fold) +
      " decodes to " + std::to_string(weights) + " weights, expected " + expected +
      "; the codes are corrupt or were encoded for another shape or dictionary");
}

}  // namespace

ffi::Error ValidationRequested(const char* op, bool* requested) {
  const char* value = std::getenv("QMOE_CUDA_VALIDATE");
  if (value == nullptr || std::strcmp(value, "") == 0 || std::strcmp(value, "0") == 0) {
    *requested = false;
  } else if (std::strcmp(value, "1") == 0) {
    *requested = true;
  } else {
    return ffi::Error::InvalidArgument(Prefix(op) + "QMOE_CUDA_VALIDATE must be 0 or 1, got '" +
                                       value + "'");
  }
  return ffi::Error::Success();
}

ffi::Error ValidateOnDevice(const char* op, const CompressedView& w, const Layout& layout,
                            ffi::ScratchAllocator& scratch, int device, cudaStream_t stream) {
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  if (cudaError_t status = cudaStreamIsCapturing(stream, &capture); status != cudaSuccess) {
    return CudaFailure(op, "querying the stream", status);
  }
  if (capture != cudaStreamCaptureStatusNone) {
    return ffi::Error::InvalidArgument(
        Prefix(op) +
        "QMOE_CUDA_VALIDATE=1 waits for the device, which cannot happen while XLA captures "
        "the call into a CUDA graph; unset QMOE_CUDA_VALIDATE, or turn XLA's command buffers "
        "off (XLA_FLAGS=--xla_gpu_enable_command_buffer=)");
  }
  if (layout.offsets_matrices > kMaxBatchSize) {
    return ffi::Error::InvalidArgument(Prefix(op) +
                                       "too many row_offsets matrices to validate on the device");
  }
  const std::optional<void*> memory =
      scratch.Allocate(sizeof(unsigned long long) + sizeof(long long), alignof(long long));
  if (!memory.has_value()) {
    return ffi::Error::Internal(Prefix(op) + "could not allocate 16 bytes for validation");
  }
  auto* first_failure = static_cast<unsigned long long*>(*memory);
  auto* weights = reinterpret_cast<long long*>(first_failure + 1);
  unsigned long long key = kNoFailure;

  cudaError_t status = cudaMemsetAsync(first_failure, 0xff, sizeof key, stream);
  if (status == cudaSuccess) {
    status = LaunchCheckOffsets(w.row_offsets, layout.offsets_matrices,
                                static_cast<int32_t>(layout.rows), layout.n_codes, first_failure,
                                device, stream);
  }
  if (status != cudaSuccess) return CudaFailure(op, "launching the validation kernel", status);
  if (auto error = Fetch(op, &key, first_failure, sizeof key, stream); error.failure()) {
    return error;
  }
  if (key != kNoFailure) return OffsetsError(op, w, layout, key, stream);

  if (layout.rows == 0 || w.batch.size == 0) return ffi::Error::Success();
  status = cudaMemsetAsync(first_failure, 0xff, sizeof key, stream);
  if (status == cudaSuccess) status = LaunchCheckRows(w, first_failure, device, stream);
  if (status != cudaSuccess) return CudaFailure(op, "launching the validation kernel", status);
  if (auto error = Fetch(op, &key, first_failure, sizeof key, stream); error.failure()) {
    return error;
  }
  if (key != kNoFailure) return BadRowError(op, w, layout, key, weights, stream);
  return ffi::Error::Success();
}

}  // namespace qmoe::cuda
