// The device kernel table, shared by the CPU and CUDA registrations (both call into the runtime,
// whose backend was chosen at init from the process group).
#pragma once

#include <torch/library.h>

#include "ops/kernels.h"

namespace dsz::ops {

inline void registerDeviceKernels(torch::Library& m)
{
    m.impl("allgather_param", &allgather_param);
    m.impl("prefetch_params_fused", &prefetch_params_fused);
    m.impl("wait_allgather", &wait_allgather);
    m.impl("release_param", &release_param);
    m.impl("reduce_grad", &reduce_grad);
    m.impl("free_tensors", &free_tensors);
    m.impl("offload_tensor", &offload_tensor);
    m.impl("reload_tensor", &reload_tensor);
    m.impl("wait_offload", &wait_offload);
    m.impl("wait_reload", &wait_reload);
    m.impl("offload_parameter", &offload_parameter);
    m.impl("reload_parameter", &reload_parameter);
    m.impl("end_backward", &end_backward);
    m.impl("test_call", &test_call);
}

}  // namespace dsz::ops
