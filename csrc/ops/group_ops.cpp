// ds_z3native's own operators (library `ds_z3native`, beside DeepSpeed's `dc`): graph rewrites of
// ds_z3native's DeepCompile patches emit them; DeepSpeed never calls them.
//
//   gather_persistent(int graph_id, Tensor[] params, int[] ids, ScalarType[]? dtypes) -> Tensor[]
//
// The full tensors of the listed params, each kept gathered by set_persistent, in one call: what
// allgather_param + wait_allgather give one param at a time (release_param keeps a persistent
// param gathered). `params` are the graph's param inputs, taken for the graph's data flow only,
// as allgather_param takes its first argument.
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <vector>

#include "core/check.h"
#include "python_gil.h"
#include "runtime.h"

namespace dsz::ops {
namespace {

using current_runtime::get;

void requireSameLength(int64_t graph_id, at::TensorList params, at::IntArrayRef ids,
                       const std::optional<std::vector<at::ScalarType>>& dtypes, const char* op)
{
    DSZ_CHECK(params.size() == ids.size(), op, "graph ", graph_id, ": ", params.size(),
              " params but ", ids.size(), " ids");
    DSZ_CHECK(!dtypes || dtypes->size() == ids.size(), op, "graph ", graph_id, ": ", ids.size(),
              " ids but ", dtypes ? dtypes->size() : 0, " dtypes");
}

std::vector<at::Tensor> gather_persistent(int64_t graph_id, at::TensorList params,
                                          at::IntArrayRef ids,
                                          std::optional<std::vector<at::ScalarType>> dtypes)
{
    requireSameLength(graph_id, params, ids, dtypes, "gather_persistent");
    GilReleasedIfHeld no_gil;  // see python_gil.h
    return get("gather_persistent")->gatherPersistent(graph_id, ids.vec(), dtypes);
}

std::vector<at::Tensor> gather_persistent_meta(int64_t graph_id, at::TensorList params,
                                               at::IntArrayRef ids,
                                               std::optional<std::vector<at::ScalarType>> dtypes)
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
            ids[i], dtypes ? std::optional<at::ScalarType>((*dtypes)[i]) : std::nullopt, op));
    }
    return out;
}

}  // namespace
}  // namespace dsz::ops

TORCH_LIBRARY(ds_z3native, m)
{
    m.def("gather_persistent(int graph_id, Tensor[] params, int[] ids, ScalarType[]? dtypes=None)"
          " -> Tensor[]");
}

// One kernel for every device: the runtime's backend decides what runs where.
TORCH_LIBRARY_IMPL(ds_z3native, CompositeExplicitAutograd, m)
{
    m.impl("gather_persistent", &dsz::ops::gather_persistent);
}

TORCH_LIBRARY_IMPL(ds_z3native, Meta, m)
{
    m.impl("gather_persistent", &dsz::ops::gather_persistent_meta);
}
