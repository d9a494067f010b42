// ds_z3native's own operators (library `ds_z3native`, beside DeepSpeed's `dc`): graph rewrites of
// ds_z3native's DeepCompile patches emit them; DeepSpeed never calls them. Their schemas, kernels
// and Meta kernels are the DSZ_OP lines of the op list (python/ds_z3native/dc_ops.def).
//
// gather_persistent(graph_id, params, ids, dtypes): the full tensors of the listed params, each
// kept gathered by set_persistent, in one call: what allgather_param + wait_allgather give one
// param at a time (release_param keeps a persistent param gathered). `params` are the graph's
// param inputs, taken for the graph's data flow only, as allgather_param takes its first
// argument. `dtypes` is empty (every param in its shard's dtype) or has one entry per id (None:
// that param's shard dtype). A list, not an optional list: torch 2.11's inductor C++ wrapper
// cannot pass an optional list to an op it calls through Python.
//
// reduce_grads(graph_id, grads, ids): reduce_grad for each (grads[i], ids[i]) in one call: every
// gradient checked before any is queued, one lock, one wait of the copy stream for the compute
// stream. Returns what reduce_grad returns (an empty tensor end_backward takes as a dependency).
//
// end_backward(deps, graph_id, release_reduce_buckets): dc::end_backward with its dependencies
// typed as what DeepCompile passes, the graph's reduce_grad(s) outputs. DeepSpeed's schema types
// them `Any`, which inductor's C++ wrapper cannot call; the kernel is the same.
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <vector>

#include "core/check.h"
#include "ops/kernels.h"
#include "ops/op_tags.h"
#include "python_gil.h"
#include "runtime.h"

namespace dsz::ops {
namespace {

using current_runtime::get;

using DtypePerId = std::vector<std::optional<at::ScalarType>>;

void requireSameLength(int64_t graph_id, at::TensorList params, at::IntArrayRef ids,
                       const DtypePerId& dtypes, const char* op)
{
    DSZ_CHECK(params.size() == ids.size(), op, "graph ", graph_id, ": ", params.size(),
              " params but ", ids.size(), " ids");
    DSZ_CHECK(dtypes.empty() || dtypes.size() == ids.size(), op, "graph ", graph_id, ": ",
              ids.size(), " ids but ", dtypes.size(), " dtypes");
}

std::vector<at::Tensor> gather_persistent(int64_t graph_id, at::TensorList params,
                                          at::IntArrayRef ids, DtypePerId dtypes)
{
    requireSameLength(graph_id, params, ids, dtypes, "gather_persistent");
    GilReleasedIfHeld no_gil;  // see python_gil.h
    std::vector<at::Tensor> out = get("gather_persistent")->gatherPersistent(graph_id, ids.vec(), dtypes);
    for (at::Tensor& t : out) { t = disjointFromInputs(t, params); }
    return out;
}

std::vector<at::Tensor> gather_persistent_meta(int64_t graph_id, at::TensorList params,
                                               at::IntArrayRef ids, DtypePerId dtypes)
{
    const char* op = "gather_persistent (meta)";
    requireSameLength(graph_id, params, ids, dtypes, op);
    DSZ_CHECK(!ids.empty(), op, "graph ", graph_id, ": no ds_ids");
    GilReleasedIfHeld no_gil;  // see python_gil.h
    auto runtime = get(op);
    std::vector<at::Tensor> out;
    out.reserve(ids.size());
    for (size_t i = 0; i < ids.size(); ++i) {
        out.push_back(runtime->gatheredMeta(
            ids[i], dtypes.empty() ? std::nullopt : dtypes[i], op));
    }
    return out;
}

void requireGroup(int64_t graph_id, at::TensorList grads, at::IntArrayRef ids, const char* op)
{
    DSZ_CHECK(grads.size() == ids.size(), op, "graph ", graph_id, ": ", grads.size(),
              " gradients but ", ids.size(), " ids");
    DSZ_CHECK(!ids.empty(), op, "graph ", graph_id, ": no ds_ids");
}

at::Tensor reduce_grads(int64_t graph_id, at::TensorList grads, at::IntArrayRef ids)
{
    requireGroup(graph_id, grads, ids, "reduce_grads");
    GilReleasedIfHeld no_gil;  // see python_gil.h
    get("reduce_grads")->reduceGrads(graph_id, ids.vec(), grads.vec());
    return at::empty({0}, grads[0].options());
}

at::Tensor reduce_grads_meta(int64_t graph_id, at::TensorList grads, at::IntArrayRef ids)
{
    const char* op = "reduce_grads (meta)";
    requireGroup(graph_id, grads, ids, op);
    for (size_t i = 0; i < ids.size(); ++i) {
        requireParamMeta(ids[i], op);
        // Outside a trace a meta gradient would be dropped without a word: it has no values.
        DSZ_CHECK(!plainMeta(grads[i]), op, "gradient of ds_id ", ids[i], " (shape ",
                  grads[i].sizes(), ") is a meta tensor: it holds no values to reduce");
    }
    return at::empty({0}, grads[0].options());
}

void end_backward_tensors(at::TensorList deps, int64_t graph_id, bool release_reduce_buckets)
{
    end_backward(c10::IValue(deps.vec()), graph_id, release_reduce_buckets);
}

void end_backward_tensors_meta(at::TensorList deps, int64_t graph_id, bool)
{
    // Fake tensors (a trace) carry the Python key; outside a trace a meta dependency stands for a
    // gradient that was never reduced, and ending the backward over it would skip the flush.
    for (size_t i = 0; i < deps.size(); ++i) {
        DSZ_CHECK(!plainMeta(deps[i]), "end_backward (meta)", "graph_id ", graph_id, ": deps[", i,
                  "] is a meta tensor (shape ", deps[i].sizes(), ") outside a fake-tensor trace: "
                  "it stands for a gradient that was never reduced, so the backward cannot be "
                  "ended (nothing was flushed)");
    }
}

}  // namespace
}  // namespace dsz::ops

TORCH_LIBRARY(ds_z3native, m)
{
#define DC_OP(name, schema, meta)  // TORCH_LIBRARY(dc) in schema.cpp
#define DSZ_OP(name, schema, kernel, meta) m.def(schema, dsz::ops::hostStatefulOpTags());
#include "ds_z3native/dc_ops.def"
#undef DC_OP
#undef DSZ_OP
}

// One kernel for every device: the runtime's backend decides what runs where.
TORCH_LIBRARY_IMPL(ds_z3native, CompositeExplicitAutograd, m)
{
#define DC_OP(name, schema, meta)
#define DSZ_OP(name, schema, kernel, meta) m.impl(#name, &dsz::ops::kernel);
#include "ds_z3native/dc_ops.def"
#undef DC_OP
#undef DSZ_OP
}

// An empty dependency list leaves the dispatcher no tensor to pick a key from.
TORCH_LIBRARY_IMPL(ds_z3native, Undefined, m)
{
    m.impl("end_backward", &dsz::ops::end_backward_tensors);
}

TORCH_LIBRARY_IMPL(ds_z3native, Meta, m)
{
#define DC_OP(name, schema, meta)
#define DSZ_OP(name, schema, kernel, meta) m.impl(#name, &dsz::ops::meta);
#include "ds_z3native/dc_ops.def"
#undef DC_OP
#undef DSZ_OP
}
