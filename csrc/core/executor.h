// Per-graph state: which params a compiled graph may touch, how many users of each gathered
// param are still pending (release_param use counts), and the ZeRO-1 local gradient accumulators.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace dsz {

enum class ZeroStage { Z1 = 1, Z2 = 2, Z3 = 3 };

class GraphExecutor {
public:
    GraphExecutor(int64_t graph_id, ZeroStage stage, const std::vector<int64_t>& ds_ids);

    int64_t graphId() const { return graph_id_; }
    ZeroStage stage() const { return stage_; }
    const std::vector<int64_t>& ids() const { return ids_; }
    bool contains(int64_t ds_id) const { return members_.count(ds_id) != 0; }
    // Throws (naming `op`, the graph and the id) unless ds_id belongs to this graph.
    void requireMember(int64_t ds_id, const char* op) const;

    // One user of ds_id is done. The first call of a round starts the count at n_users.
    // Returns true when this was the last user, so the gathered copy can be freed.
    bool releaseUse(int64_t ds_id, int64_t n_users, const char* op);
    int64_t pendingUses(int64_t ds_id) const;
    // Ends every round in progress: the next release of each param starts a new one. For a run
    // of the graph that stopped between releases (DeepSpeed's profiler carries on after an
    // error), whose gathered copies were dropped.
    void clearUses() { use_counts_.clear(); }

    // ZeRO-1: gradients are summed locally until the accumulation boundary.
    void accumulateLocal(int64_t ds_id, const at::Tensor& grad);
    // Removes and returns the local sum (undefined when nothing was accumulated).
    at::Tensor takeLocal(int64_t ds_id);
    size_t localCount() const { return local_grads_.size(); }

    // True between start_backward(update=true) and the next start_backward.
    bool updating = false;

private:
    int64_t graph_id_;
    ZeroStage stage_;
    std::vector<int64_t> ids_;
    std::unordered_set<int64_t> members_;
    std::unordered_map<int64_t, int64_t> use_counts_;
    std::unordered_map<int64_t, at::Tensor> local_grads_;
};

}  // namespace dsz
