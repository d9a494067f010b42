// The device kernel table, shared by the CPU and CUDA registrations (both call into the runtime,
// whose backend was chosen at init from the process group).
#pragma once

#include <torch/library.h>

#include "ops/kernels.h"

namespace dsz::ops {

inline void registerDeviceKernels(torch::Library& m)
{
#define DC_OP(name, schema, meta) m.impl(#name, &name);
#define DSZ_OP(name, schema, kernel, meta)  // ds_z3native::, group_ops.cpp
#include "ds_z3native/dc_ops.def"
#undef DC_OP
#undef DSZ_OP
}

}  // namespace dsz::ops
