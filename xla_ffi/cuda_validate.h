// Checking the bytes of the compressed operands on the device.
//
// The CUDA handlers never read out of bounds whatever the bytes (see
// cuda_decode.cuh); a row whose codes or offsets are corrupt turns what
// depends on it into NaN, without a device-to-host round trip. Telling the
// caller *which* row is corrupt, as the CPU handlers do with an error, needs
// the device's answer before the handler returns, that is a stream
// synchronization per call: it stalls the host until the GPU drains, so
// kernels stop overlapping with the host's dispatch, and it is illegal while
// XLA captures the call into a CUDA graph (command buffer). So it is opt-in:
// with QMOE_CUDA_VALIDATE=1 in the environment, each handler first runs the
// CPU handlers' checks on the device, waits, and returns the same
// INVALID_ARGUMENT message the CPU handler would; a debugging mode, read at
// every call.
#pragma once

#include <cuda_runtime.h>

#include "cuda_launch.h"
#include "cuda_operands.h"
#include "xla/ffi/api/ffi.h"

namespace qmoe::cuda {

// Sets *requested from QMOE_CUDA_VALIDATE (unset, empty or 0: no; 1: yes).
xla::ffi::Error ValidationRequested(const char* op, bool* requested);

// Checks row_offsets (start at 0, never decrease, end within codes) and that
// every row decodes to exactly 2 * ceil(cols / 2) weights; synchronizes
// `stream`. Refuses to run while the stream is being captured into a graph.
xla::ffi::Error ValidateOnDevice(const char* op, const CompressedView& w, const Layout& layout,
                                 xla::ffi::ScratchAllocator& scratch, int device,
                                 cudaStream_t stream);

}  // namespace qmoe::cuda
