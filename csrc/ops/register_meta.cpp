#include <torch/library.h>

#include "ops/kernels.h"

using namespace dsz::ops;

TORCH_LIBRARY_IMPL(dc, Meta, m)
{
    m.impl("allgather_param", &allgather_param_meta);
    m.impl("prefetch_params_fused", &prefetch_params_fused_meta);
    m.impl("wait_allgather", &wait_allgather_meta);
    m.impl("release_param", &release_param_meta);
    m.impl("reduce_grad", &reduce_grad_meta);
    m.impl("free_tensors", &free_tensors_meta);
    m.impl("offload_tensor", &like_meta);
    m.impl("reload_tensor", &like_meta);
    m.impl("wait_offload", &like_meta);
    m.impl("wait_reload", &like_meta);
    m.impl("offload_parameter", &offload_parameter_meta);
    m.impl("reload_parameter", &reload_parameter_meta);
    m.impl("end_backward", &end_backward_meta);
    m.impl("test_call", &test_call_meta);
}
