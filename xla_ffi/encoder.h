// Host-side dictionary encoder of format v1 (docs/format.md §5), bound into the
// Python module qmoe_jax_ext as class `EncoderTable`.
#pragma once

#include <pybind11/pybind11.h>

namespace qmoe {

// Adds `EncoderTable` to the extension module.
void RegisterEncoder(pybind11::module_& m);

}  // namespace qmoe
