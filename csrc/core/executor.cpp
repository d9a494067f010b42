#include "core/executor.h"

#include "core/check.h"

namespace dsz {

GraphExecutor::GraphExecutor(int64_t graph_id, ZeroStage stage, const std::vector<int64_t>& ds_ids)
    : graph_id_(graph_id), stage_(stage), ids_(ds_ids), members_(ds_ids.begin(), ds_ids.end())
{
}

void GraphExecutor::requireMember(int64_t ds_id, const char* op) const
{
    DSZ_CHECK(contains(ds_id), op, "ds_id ", ds_id, " is not a parameter of graph ", graph_id_,
              " (register_graph listed ", ids_.size(), " ids)");
}

bool GraphExecutor::releaseUse(int64_t ds_id, int64_t n_users, const char* op)
{
    requireMember(ds_id, op);
    DSZ_CHECK(n_users >= 1, op, "n_users must be >= 1 for ds_id ", ds_id, " in graph ", graph_id_,
              ", got ", n_users);
    int64_t& count = use_counts_[ds_id];
    if (count == 0) { count = n_users; }
    --count;
    return count == 0;
}

int64_t GraphExecutor::pendingUses(int64_t ds_id) const
{
    auto it = use_counts_.find(ds_id);
    return it == use_counts_.end() ? 0 : it->second;
}

void GraphExecutor::accumulateLocal(int64_t ds_id, const at::Tensor& grad)
{
    auto it = local_grads_.find(ds_id);
    if (it == local_grads_.end()) {
        // A private copy: the caller's gradient tensor is never modified.
        local_grads_.emplace(ds_id, grad.detach().clone());
    } else {
        it->second.add_(grad);
    }
}

at::Tensor GraphExecutor::takeLocal(int64_t ds_id)
{
    auto it = local_grads_.find(ds_id);
    if (it == local_grads_.end()) { return at::Tensor(); }
    at::Tensor t = std::move(it->second);
    local_grads_.erase(it);
    return t;
}

}  // namespace dsz
