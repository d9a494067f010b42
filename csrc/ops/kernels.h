// Kernels of the dc ops (python/ds_z3native/dc_ops.def lists the ops). The device kernels validate
// nothing themselves: each is a thin call into the runtime, which checks ids and values. The Meta
// kernels compute shapes only.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

#include <optional>
#include <vector>

namespace dsz::ops {

// Device kernels (CPU and CUDA keys; the runtime's backend decides what runs where).
at::Tensor allgather_param(const at::Tensor& a, int64_t graph_id, int64_t id,
                           std::optional<at::ScalarType> dtype);
void prefetch_params_fused(int64_t graph_id, at::TensorList params, at::IntArrayRef ids,
                           std::optional<std::vector<at::ScalarType>> dtypes);
at::Tensor wait_allgather(const at::Tensor& a, int64_t graph_id, int64_t id);
at::Tensor release_param(const at::Tensor& a, int64_t graph_id, int64_t id, int64_t n_users);
at::Tensor reduce_grad(const at::Tensor& a, int64_t graph_id, int64_t id);
void free_tensors(at::TensorList a);
at::Tensor offload_tensor(const at::Tensor& a, int64_t graph_id, int64_t id);
at::Tensor reload_tensor(const at::Tensor& a, int64_t graph_id, int64_t id);
at::Tensor wait_offload(const at::Tensor& a, int64_t graph_id, int64_t id);
at::Tensor wait_reload(const at::Tensor& a, int64_t graph_id, int64_t id);
void offload_parameter(const at::Tensor& a, int64_t graph_id, int64_t id);
void reload_parameter(const at::Tensor& a, int64_t graph_id, int64_t id);
void end_backward(const c10::IValue& deps, int64_t graph_id, bool release_reduce_buckets);
at::Tensor test_call(const at::Tensor& a);

// Shared by the Meta kernels (also those of group_ops.cpp): throws naming `op` when ds_id is not
// registered; whether `t` is a meta tensor outside a fake-tensor trace (it holds no values).
void requireParamMeta(int64_t id, const char* op);
// `out`, or a copy of it where its memory overlaps the memory of one of `inputs` (torch's
// custom-op contract: an output aliases no input). A gathered param on one rank is the shard's
// memory; a param input whose data still lies in ZeRO-3's flat buffer would overlap it.
at::Tensor disjointFromInputs(const at::Tensor& out, at::TensorList inputs);
bool plainMeta(const at::Tensor& t);

// Meta kernels, one per line of the op list, each with its device kernel's type (the list names
// it; ops shaped like their input share one).
#define DC_OP(name, schema, meta) decltype(name) meta;
#define DSZ_OP(name, schema, kernel, meta)  // ds_z3native::, group_ops.cpp
#include "ds_z3native/dc_ops.def"
#undef DC_OP
#undef DSZ_OP

}  // namespace dsz::ops
