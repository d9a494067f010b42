// The one object init() creates and cleanup() ends. It owns the collectives, the device streams,
// the parameter registry, the graph executors and the reduce buckets; every dc op and module
// function is a method here. Device-independent: the backends are handed in.
#pragma once

#include <ATen/core/Tensor.h>

#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "comm/collectives.h"
#include "core/activation_offload.h"
#include "core/executor.h"
#include "core/gatherer.h"
#include "core/grad_reducer.h"
#include "core/param_registry.h"
#include "core/stats.h"
#include "device/device.h"

namespace dsz {

// DeepSpeed's compile config, as far as the native layer reads it.
struct RuntimeConfig {
    int64_t reduce_bucket_size = 500000000;  // elements per dtype bucket
    bool double_buffer = true;
    bool symmetric_memory = false;  // accepted; gathers always go through the collectives backend
    int64_t free_activation_threshold = 0;
    bool sync_before_reduce = false;
    bool sync_after_reduce = false;
    bool sync_before_allgather = false;
    bool sync_after_allgather = false;
    bool offload_activation_pin_memory = true;
    // Bytes that set_persistent (DeepCompile's selective gather) may keep gathered; unset = no
    // limit (DeepSpeed's behaviour). Params registered persistent do not count (DeepCompile
    // registers none). Must be equal on every rank: an accepted param is gathered at once.
    std::optional<int64_t> persistence_budget_bytes;
};

class Runtime {
public:
    Runtime(std::unique_ptr<Collectives> comm,
            std::unique_ptr<DeviceBackend> device,
            RuntimeConfig config);
    ~Runtime();
    // Throws (naming init and the value) when the constructor would refuse `config`; init()
    // checks it before it ends the live runtime.
    static void checkConfig(const RuntimeConfig& config);

    // --- module functions (DeepSpeed's names in the comments) ---
    void registerZ3Param(int64_t ds_id, const std::vector<int64_t>& shape, const at::Tensor& shard,
                         const at::Tensor& grad_buffer, bool persistent,
                         std::optional<at::ScalarType> expected_grad_dtype);  // register_z3_param
    void registerParam(int64_t ds_id, const std::vector<int64_t>& shape, const at::Tensor& param,
                       const at::Tensor& grad_buffer, int64_t offset);  // register_param (Z1/2)
    void updateParamGradBuffer(int64_t ds_id, const at::Tensor& grad_buffer, int64_t offset);
    void registerGraph(int64_t graph_id, const std::vector<int64_t>& ds_ids, ZeroStage stage);
    // A second id for a registered graph: the dc ops resolve alias_id to graph_id. ds_z3native
    // gives DeepCompile's graphs ids that are the same in every run (DeepSpeed's are memory
    // addresses), so that compiled code, which bakes the id in, can come from a cache.
    void aliasGraph(int64_t alias_id, int64_t graph_id);
    std::map<int64_t, int64_t> graphAliases();
    void setPersistent(int64_t ds_id);
    // Changes the budget of set_persistent for the rest of the run (already persistent params
    // stay); unset = no limit.
    void setPersistenceBudget(std::optional<int64_t> bytes);
    struct PersistenceUse {
        std::optional<int64_t> budget_bytes;
        int64_t selected_bytes;  // kept gathered because of set_persistent
        int64_t selected;        // params set persistent
        int64_t declined;        // set_persistent calls over the budget (the param stays released)
    };
    PersistenceUse persistenceUse();
    void setParamFrozen(int64_t ds_id, bool frozen);
    bool isParamFrozen(int64_t ds_id);
    void startForward();
    void endForward();
    void startBackward(bool update);
    void reset();  // drops the graph executors (DeepSpeed recompiles); params stay
    void enableProfiling(bool enable);
    bool isProfiling();
    void invalidateGatheredParam(int64_t ds_id);
    void clearAllGatheredParams();

    // --- dc ops ---
    at::Tensor allgatherParam(int64_t graph_id, int64_t ds_id, std::optional<at::ScalarType> dtype);
    void prefetchParamsFused(int64_t graph_id, const std::vector<int64_t>& ds_ids,
                             const std::optional<std::vector<at::ScalarType>>& dtypes);
    void waitAllgather(int64_t graph_id, int64_t ds_id);
    void releaseParam(int64_t graph_id, int64_t ds_id, int64_t n_users);
    // ds_z3native's own op (not DeepSpeed's): the full tensors of params kept gathered
    // (set_persistent), in one call for a graph's group; gathers the ones without a valid copy
    // (trainable params after an optimizer step) in one collective group and waits for them.
    // Refuses a param that is not persistent: nothing would ever release its gathered copy.
    // `dtypes`: empty (every param in its shard's dtype) or one per id (nullopt: the shard's).
    std::vector<at::Tensor> gatherPersistent(
        int64_t graph_id, const std::vector<int64_t>& ds_ids,
        const std::vector<std::optional<at::ScalarType>>& dtypes);
    void reduceGrad(int64_t graph_id, int64_t ds_id, const at::Tensor& grad);
    // ds_z3native's own op: reduce_grad for several gradients in one call (one lock, one wait of
    // the copy stream for the compute stream). Every id and gradient is checked before any is
    // queued: a refusal queues none of them.
    void reduceGrads(int64_t graph_id, const std::vector<int64_t>& ds_ids,
                     const std::vector<at::Tensor>& grads);
    // Refused before any state changes while no backward has begun (start_backward never called
    // since init), except for DeepSpeed's profiler, which runs backward graphs with profiling on
    // and may do so before the first start_backward; see runtime.cpp.
    void endBackward(int64_t graph_id, bool release_reduce_buckets);
    void freeTensors(const std::vector<at::Tensor>& tensors);
    at::Tensor offloadTensor(const at::Tensor& t, int64_t graph_id, int64_t id);
    at::Tensor reloadTensor(int64_t graph_id, int64_t id);
    at::Tensor waitOffload(int64_t graph_id, int64_t id);
    at::Tensor waitReload(const at::Tensor& t, int64_t graph_id, int64_t id);
    void offloadParameter(int64_t graph_id, int64_t ds_id);
    void reloadParameter(int64_t graph_id, int64_t ds_id);
    at::Tensor gatheredMeta(int64_t ds_id, std::optional<at::ScalarType> dtype,
                            const char* op = "allgather_param (meta)");
    // Throws naming `op` when ds_id is not registered (the Meta kernels' check).
    void requireParam(int64_t ds_id, const char* op);

    // --- introspection ---
    int64_t rank() const { return comm_->rank(); }
    int64_t worldSize() const { return comm_->worldSize(); }
    const char* commName() const { return comm_->name(); }
    const char* deviceName() const { return device_->name(); }
    CommStats stats();
    void resetStats();
    // A snapshot of one param's state (for tests and diagnostics).
    struct ParamState {
        bool frozen, persistent, partitioned, gathered, valid, grad_accumulated;
        int64_t numel, shard_numel, grad_numel;
    };
    ParamState paramState(int64_t ds_id);
    std::vector<int64_t> graphIds();
    size_t pendingGradients();

    // The lock every entry point takes (autograd may call from its own thread).
    std::mutex& mutex() { return mutex_; }

private:
    int64_t resolve(int64_t graph_id) const;  // an alias's graph, or graph_id itself
    GraphExecutor& executor(int64_t graph_id, const char* op);
    ParamEntry& member(GraphExecutor& ex, int64_t ds_id, const char* op);
    ActivationOffload& offloadFor(int64_t graph_id, const char* op);
    void requireQueuedStaysReducible(const ParamEntry& next, const char* op);
    // The params of `ds_ids` in graph `ex` with their dtypes (refused: an id listed twice, not a
    // member, or a dtype list of another length), for the ops that take a group. `dtypes`: empty
    // (the shards' dtypes) or one per id.
    void groupOf(GraphExecutor& ex, int64_t graph_id, const std::vector<int64_t>& ds_ids,
                 const std::vector<std::optional<at::ScalarType>>& dtypes, const char* op,
                 std::vector<ParamEntry*>& params,
                 std::vector<std::optional<at::ScalarType>>& types);

    std::unique_ptr<Collectives> comm_;
    std::unique_ptr<DeviceBackend> device_;
    RuntimeConfig config_;
    CommStats stats_;
    ParamRegistry registry_;
    Gatherer gatherer_;
    GradReducer reducer_;
    std::map<int64_t, GraphExecutor> executors_;
    std::map<int64_t, ActivationOffload> offloads_;
    std::map<int64_t, int64_t> aliases_;  // alias id -> registered graph id
    bool profiling_ = false;
    bool updating_ = false;       // the current backward ends an accumulation window
    PersistenceUse persistence_{std::nullopt, 0, 0, 0};
    bool window_closed_ = true;   // the previous backward ended one: gradients start afresh
    bool backward_started_ = false;  // start_backward was called since init (see endBackward)
    std::mutex mutex_;
};

// What the next init() takes from ds_z3native's settings rather than from DeepSpeed's config
// (init's signature is DeepSpeed's): set explicitly by the Python package, never read from the
// environment here.
struct RuntimeDefaults {
    std::optional<int64_t> persistence_budget_bytes;  // unset = no limit
};

// The process-wide runtime: created by init(), ended by cleanup(). Every op and function holds a
// counted reference for its whole call, so cleanup(), init() or reset() from another thread never
// frees what a running call uses: the runtime is destroyed when its last call returns.
namespace current_runtime {
// Throws naming `op` when init() has not been called.
std::shared_ptr<Runtime> get(const char* op);
std::shared_ptr<Runtime> tryGet();
void replace(std::shared_ptr<Runtime> runtime);  // ends the previous one first
void destroy();
// The defaults of the next init(); kept across cleanup(). setDefaults throws naming `op` and the
// value for a negative budget.
void setDefaults(const RuntimeDefaults& defaults, const char* op);
RuntimeDefaults defaults();
}  // namespace current_runtime

}  // namespace dsz
