#include "runtime.h"

#include <ATen/ops/empty.h>

#include <unordered_set>

#include "core/check.h"

namespace dsz {

#define DSZ_LOCK std::lock_guard<std::mutex> guard_(mutex_)

namespace {

// A set_persistent budget: unset (no limit) or a number of bytes >= 0.
std::optional<int64_t> checkedBudget(std::optional<int64_t> bytes, const char* op)
{
    DSZ_CHECK(!bytes || *bytes >= 0, op, "the persistence budget must be >= 0 bytes, got ",
              bytes.value_or(0));
    return bytes;
}

int64_t numelOf(const std::vector<int64_t>& shape, const char* op, int64_t ds_id)
{
    int64_t n = 1;
    for (int64_t d : shape) {
        DSZ_CHECK(d >= 0, op, "ds_id ", ds_id, " has a negative dimension in ds_shape: ", d);
    }
    for (int64_t d : shape) {
        // A wrapped product (e.g. [2**32, 2**32] -> 0) would register a param of the wrong size.
        DSZ_CHECK(!__builtin_mul_overflow(n, d, &n), op, "ds_id ", ds_id,
                  ": the element count of ds_shape ", c10::IntArrayRef(shape),
                  " overflows int64");
    }
    return n;
}

// Checks a non-empty grad buffer against the param it serves (ZeRO-3: it holds the whole
// shard; ZeRO-1/2: it fits inside the param at `offset`) and zeroes it. Empty or undefined
// buffers pass untouched.
void prepareGradBuffer(const at::Tensor& buf, const ParamEntry& e, int64_t offset, const char* op)
{
    if (!buf.defined() || buf.numel() == 0) { return; }
    DSZ_CHECK(hasData(buf), op, "grad buffer of ds_id ", e.ds_id, " (shape ", buf.sizes(),
              ") has no data (a meta tensor, or its storage was freed)");
    DSZ_CHECK(at::isFloatingType(buf.scalar_type()), op, "grad buffer of ds_id ", e.ds_id,
              " must be floating point, got ", buf.scalar_type());
    DSZ_CHECK(buf.is_contiguous(), op, "grad buffer of ds_id ", e.ds_id, " must be contiguous");
    if (e.partitioned) {
        DSZ_CHECK(buf.numel() >= e.layout.per_rank, op, "grad buffer of ds_id ", e.ds_id, " has ",
                  buf.numel(), " elements, its shard needs ceil(", e.numel, " / ",
                  e.layout.world_size, ") = ", e.layout.per_rank);
    } else {
        DSZ_CHECK(offset >= 0 && offset + buf.numel() <= e.numel, op, "ds_id ", e.ds_id,
                  ": grad buffer of ", buf.numel(), " elements at offset ", offset,
                  " does not fit a param of ", e.numel);
    }
    buf.zero_();
}

}  // namespace

Runtime::Runtime(std::unique_ptr<Collectives> comm,
                 std::unique_ptr<DeviceBackend> device,
                 RuntimeConfig config)
    : comm_(std::move(comm)),
      device_(std::move(device)),
      config_(config),
      gatherer_(*comm_, *device_, stats_),
      reducer_(registry_, *comm_, *device_, stats_, config.reduce_bucket_size, config.double_buffer)
{
    checkConfig(config);
    persistence_.budget_bytes = config.persistence_budget_bytes;
}

void Runtime::checkConfig(const RuntimeConfig& config)
{
    DSZ_CHECK(config.reduce_bucket_size >= 1, "init",
              "initial_reduce_bucket_size must be >= 1, got ", config.reduce_bucket_size);
    DSZ_CHECK(config.free_activation_threshold >= 0, "init",
              "free_activation_threshold must be >= 0, got ", config.free_activation_threshold);
    checkedBudget(config.persistence_budget_bytes, "init");
}

Runtime::~Runtime() = default;

int64_t Runtime::resolve(int64_t graph_id) const
{
    auto a = aliases_.find(graph_id);
    return a == aliases_.end() ? graph_id : a->second;
}

GraphExecutor& Runtime::executor(int64_t graph_id, const char* op)
{
    auto it = executors_.find(resolve(graph_id));
    DSZ_CHECK(it != executors_.end(), op, "unknown graph_id ", graph_id,
              " (not registered with register_graph_z1/z2/z3, or dropped by reset(); ",
              executors_.size(), " graphs registered)");
    return it->second;
}

ParamEntry& Runtime::member(GraphExecutor& ex, int64_t ds_id, const char* op)
{
    ParamEntry& p = registry_.get(ds_id, op);
    ex.requireMember(ds_id, op);
    return p;
}

// A gradient already queued for `next.ds_id` must still be reducible once `next` replaces the
// entry; otherwise the bucket flush would have to refuse it (and ranks would disagree).
void Runtime::requireQueuedStaysReducible(const ParamEntry& next, const char* op)
{
    const int64_t slot = reducer_.queuedSlotNumel(next.ds_id);
    if (slot < 0) { return; }
    try {
        DSZ_CHECK(next.slotNumel() == slot, op, "ds_id ", next.ds_id,
                  " would take ", next.slotNumel(), " elements in a reduce bucket, its queued "
                  "gradient takes ", slot);
        GradReducer::requireReducible(next, op);
    } catch (const c10::Error& e) {
        DSZ_FAIL(op, "ds_id ", next.ds_id, " has a gradient queued for reduction that this "
                 "change would drop; call it after end_backward. (", e.what_without_backtrace(),
                 ")");
    }
}

// ---------------------------------------------------------------- registration

void Runtime::registerZ3Param(int64_t ds_id, const std::vector<int64_t>& shape,
                              const at::Tensor& shard, const at::Tensor& grad_buffer,
                              bool persistent, std::optional<at::ScalarType> expected_grad_dtype)
{
    DSZ_LOCK;
    const char* op = "register_z3_param";
    DSZ_CHECK(shard.defined(), op, "ds_tensor of ds_id ", ds_id, " is undefined");
    DSZ_CHECK(hasData(shard), op, "ds_tensor of ds_id ", ds_id, " (shape ", shard.sizes(),
              ") has no data (a meta tensor, or its storage was freed)");
    ParamEntry e;
    e.ds_id = ds_id;
    e.shape = shape;
    e.numel = numelOf(shape, op, ds_id);
    e.layout = ShardLayout::of(e.numel, comm_->worldSize(), op);
    DSZ_CHECK(shard.numel() == e.layout.per_rank, op, "ds_tensor of ds_id ", ds_id, " has ",
              shard.numel(), " elements, expected ceil(", e.numel, " / ", e.layout.world_size,
              ") = ", e.layout.per_rank);
    e.shard = shard;
    e.partitioned = true;
    e.persistent = persistent;
    e.expected_grad_dtype = expected_grad_dtype;
    if (expected_grad_dtype) {
        DSZ_CHECK(GradReducer::reducibleDtype(*expected_grad_dtype), op,
                  "expected_grad_dtype of ds_id ", ds_id,
                  " must be Float, Double, Half or BFloat16, got ", *expected_grad_dtype);
    }
    // DeepSpeed registers a param without gradients with an undefined buffer (an empty one, for
    // a param with elements, means the same). A trainable param without elements has an empty
    // grad partition: it stays trainable, and its gradient reduces to nothing.
    e.frozen = !grad_buffer.defined() || (grad_buffer.numel() == 0 && e.numel > 0);
    if (!e.frozen) {
        prepareGradBuffer(grad_buffer, e, 0, op);
        e.grad_buffer = grad_buffer;
    }
    requireQueuedStaysReducible(e, op);
    // Registering an id again replaces it (and drops its gathered copy): the latest shard wins.
    registry_.put(std::move(e));
}

void Runtime::registerParam(int64_t ds_id, const std::vector<int64_t>& shape,
                            const at::Tensor& param, const at::Tensor& grad_buffer, int64_t offset)
{
    DSZ_LOCK;
    const char* op = "register_param";
    DSZ_CHECK(param.defined(), op, "param of ds_id ", ds_id, " is undefined");
    DSZ_CHECK(hasData(param), op, "param of ds_id ", ds_id, " (shape ", param.sizes(),
              ") has no data (a meta tensor, or its storage was freed)");
    ParamEntry e;
    e.ds_id = ds_id;
    e.shape = shape;
    e.numel = numelOf(shape, op, ds_id);
    DSZ_CHECK(param.numel() == e.numel, op, "param of ds_id ", ds_id, " has ", param.numel(),
              " elements but ds_shape says ", e.numel);
    e.layout = ShardLayout::of(e.numel, comm_->worldSize(), op);
    e.shard = param;
    e.partitioned = false;
    // Checked before the entry is stored: a refused call leaves the registry as it was.
    ParamEntry check = e;
    check.grad_buffer = grad_buffer;
    requireQueuedStaysReducible(check, op);
    prepareGradBuffer(grad_buffer, e, offset, op);
    e.grad_buffer = grad_buffer;
    e.grad_offset = offset;
    registry_.put(std::move(e));
}

void Runtime::updateParamGradBuffer(int64_t ds_id, const at::Tensor& grad_buffer, int64_t offset)
{
    DSZ_LOCK;
    const char* op = "update_param_grad_buffer";
    ParamEntry& p = registry_.get(ds_id, op);
    ParamEntry check = p;
    check.grad_buffer = grad_buffer;
    requireQueuedStaysReducible(check, op);
    prepareGradBuffer(grad_buffer, p, offset, op);
    p.grad_buffer = grad_buffer;
    p.grad_offset = offset;
}

void Runtime::registerGraph(int64_t graph_id, const std::vector<int64_t>& ds_ids, ZeroStage stage)
{
    DSZ_LOCK;
    const char* op = stage == ZeroStage::Z3 ? "register_graph_z3"
                     : stage == ZeroStage::Z2 ? "register_graph_z2" : "register_graph_z1";
    std::unordered_set<int64_t> seen;
    for (int64_t id : ds_ids) {
        // ZeRO-3 registers every module param first; ZeRO-1/2 graphs may list frozen params
        // that the optimizer (and so register_param) never saw.
        if (stage == ZeroStage::Z3) { registry_.get(id, op); }
        DSZ_CHECK(seen.insert(id).second, op, "ds_id ", id, " listed twice for graph ", graph_id);
    }
    auto alias = aliases_.find(graph_id);
    DSZ_CHECK(alias == aliases_.end(), op, "graph_id ", graph_id, " is already an alias of graph ",
              alias->second);  // the message is built only when the check fails
    executors_.erase(graph_id);
    offloads_.erase(graph_id);
    executors_.emplace(std::piecewise_construct, std::forward_as_tuple(graph_id),
                       std::forward_as_tuple(graph_id, stage, ds_ids));
}

void Runtime::aliasGraph(int64_t alias_id, int64_t graph_id)
{
    DSZ_LOCK;
    const char* op = "alias_graph";
    DSZ_CHECK(executors_.count(graph_id) == 1, op, "alias ", alias_id, ": graph_id ", graph_id,
              " is not registered (", executors_.size(), " graphs registered)");
    DSZ_CHECK(executors_.count(alias_id) == 0, op, "alias ", alias_id,
              " is itself a registered graph_id");
    auto [it, added] = aliases_.emplace(alias_id, graph_id);
    DSZ_CHECK(added || it->second == graph_id, op, "alias ", alias_id, " already names graph ",
              it->second, ", not ", graph_id);
}

std::map<int64_t, int64_t> Runtime::graphAliases()
{
    DSZ_LOCK;
    return aliases_;
}

void Runtime::setPersistent(int64_t ds_id)
{
    DSZ_LOCK;
    ParamEntry& p = registry_.get(ds_id, "set_persistent");
    DSZ_CHECK(p.partitioned, "set_persistent", "ds_id ", ds_id, " is not a ZeRO-3 parameter");
    if (!p.persistent) {
        // A hint from DeepCompile's selective gather: over the budget, the param simply keeps
        // being gathered and released at each use.
        // Bytes the kept copy takes beyond the shard: none where the copy is the shard.
        const int64_t bytes =
            gatherer_.aliasesShard(p, p.shard.scalar_type()) ? 0 : p.paddedShardBytes();
        const auto& budget = persistence_.budget_bytes;
        if (budget && persistence_.selected_bytes + bytes > *budget) {
            persistence_.declined += 1;
            return;
        }
        persistence_.selected_bytes += bytes;
        persistence_.selected += 1;
    }
    p.persistent = true;
    // Gather now, outside forward and backward, so the long-lived buffer does not fragment
    // the memory the graphs use.
    if (!p.valid) {
        gatherer_.gather(p, std::nullopt, "set_persistent");
        gatherer_.wait(p);
    }
}

void Runtime::setPersistenceBudget(std::optional<int64_t> bytes)
{
    DSZ_LOCK;
    persistence_.budget_bytes = checkedBudget(bytes, "set_persistence_budget");
}

Runtime::PersistenceUse Runtime::persistenceUse()
{
    DSZ_LOCK;
    return persistence_;
}

void Runtime::setParamFrozen(int64_t ds_id, bool frozen)
{
    DSZ_LOCK;
    const char* op = "set_param_frozen";
    ParamEntry& p = registry_.get(ds_id, op);
    ParamEntry check = p;
    check.frozen = frozen;
    requireQueuedStaysReducible(check, op);
    p.frozen = frozen;
}

bool Runtime::isParamFrozen(int64_t ds_id)
{
    DSZ_LOCK;
    return registry_.get(ds_id, "is_param_frozen").frozen;
}

void Runtime::startForward() {}
void Runtime::endForward() {}

void Runtime::startBackward(bool update)
{
    DSZ_LOCK;
    if (window_closed_) {
        // The optimizer consumed the last window's gradients: the next reduction overwrites.
        for (auto& [id, p] : registry_.entries()) { p.grad_accumulated = false; }
    }
    window_closed_ = update;
    updating_ = update;
    backward_started_ = true;
    for (auto& [id, ex] : executors_) { ex.updating = update; }
}

void Runtime::reset()
{
    DSZ_LOCK;
    executors_.clear();
    offloads_.clear();
    aliases_.clear();
}

void Runtime::enableProfiling(bool enable)
{
    DSZ_LOCK;
    profiling_ = enable;
}

bool Runtime::isProfiling()
{
    DSZ_LOCK;
    return profiling_;
}

void Runtime::invalidateGatheredParam(int64_t ds_id)
{
    DSZ_LOCK;
    ParamEntry& p = registry_.get(ds_id, "invalidate_gathered_param");
    if (p.persistent) { return; }
    gatherer_.forget(p, /*keep_placeholder=*/true);
}

void Runtime::clearAllGatheredParams()
{
    DSZ_LOCK;
    for (auto& [id, p] : registry_.entries()) {
        if (!p.persistent && p.has_gathered) { gatherer_.forget(p, /*keep_placeholder=*/false); }
    }
    // DeepSpeed's profiler calls this after running a graph, also one that stopped midway (it
    // carries on with default figures): a use count that run started would carry over and free
    // the next real gather before its last user.
    for (auto& [id, ex] : executors_) { ex.clearUses(); }
}

// ---------------------------------------------------------------- ops

at::Tensor Runtime::allgatherParam(int64_t graph_id, int64_t ds_id,
                                   std::optional<at::ScalarType> dtype)
{
    DSZ_LOCK;
    const char* op = "allgather_param";
    ParamEntry& p = member(executor(graph_id, op), ds_id, op);
    if (config_.sync_before_allgather) { device_->synchronizeDevice(); }
    at::Tensor out = gatherer_.gather(p, dtype, op);
    if (config_.sync_after_allgather) { device_->synchronizeDevice(); }
    return out;
}

void Runtime::groupOf(GraphExecutor& ex, int64_t graph_id, const std::vector<int64_t>& ds_ids,
                      const std::vector<std::optional<at::ScalarType>>& dtypes, const char* op,
                      std::vector<ParamEntry*>& params,
                      std::vector<std::optional<at::ScalarType>>& types)
{
    DSZ_CHECK(dtypes.empty() || dtypes.size() == ds_ids.size(), op, "graph ", graph_id, ": ",
              ds_ids.size(), " ids but ", dtypes.size(), " dtypes");
    std::unordered_set<int64_t> seen;
    for (size_t i = 0; i < ds_ids.size(); ++i) {
        DSZ_CHECK(seen.insert(ds_ids[i]).second, op, "ds_id ", ds_ids[i], " listed twice");
        params.push_back(&member(ex, ds_ids[i], op));
        types.push_back(dtypes.empty() ? std::nullopt : dtypes[i]);
    }
}

void Runtime::prefetchParamsFused(int64_t graph_id, const std::vector<int64_t>& ds_ids,
                                  const std::optional<std::vector<at::ScalarType>>& dtypes)
{
    DSZ_LOCK;
    const char* op = "prefetch_params_fused";
    GraphExecutor& ex = executor(graph_id, op);
    std::vector<ParamEntry*> params;
    std::vector<std::optional<at::ScalarType>> types;
    std::vector<std::optional<at::ScalarType>> per_id;
    if (dtypes) { per_id.assign(dtypes->begin(), dtypes->end()); }
    groupOf(ex, graph_id, ds_ids, per_id, op, params, types);
    if (config_.sync_before_allgather) { device_->synchronizeDevice(); }
    gatherer_.prefetch(params, types, op);
    if (config_.sync_after_allgather) { device_->synchronizeDevice(); }
}

void Runtime::waitAllgather(int64_t graph_id, int64_t ds_id)
{
    DSZ_LOCK;
    const char* op = "wait_allgather";
    ParamEntry& p = member(executor(graph_id, op), ds_id, op);
    DSZ_CHECK(p.has_gathered, op, "ds_id ", ds_id, " of graph ", graph_id,
              " is not gathered: wait_allgather without a preceding allgather_param or "
              "prefetch_params_fused, or after its last release_param");
    gatherer_.wait(p);
}

void Runtime::releaseParam(int64_t graph_id, int64_t ds_id, int64_t n_users)
{
    DSZ_LOCK;
    const char* op = "release_param";
    GraphExecutor& ex = executor(graph_id, op);
    ParamEntry& p = member(ex, ds_id, op);
    // Checked before the use count changes: a count started without a gather would carry over
    // and free the next real gather after its first user.
    DSZ_CHECK(p.has_gathered, op, "ds_id ", ds_id, " of graph ", graph_id, " (n_users ", n_users,
              ") is not gathered: release_param without a preceding allgather_param, or a "
              "release after its last user");
    if (ex.releaseUse(ds_id, n_users, op) && !p.persistent) { gatherer_.free(p, op); }
}

std::vector<at::Tensor> Runtime::gatherPersistent(
    int64_t graph_id, const std::vector<int64_t>& ds_ids,
    const std::vector<std::optional<at::ScalarType>>& dtypes)
{
    DSZ_LOCK;
    const char* op = "gather_persistent";
    GraphExecutor& ex = executor(graph_id, op);
    DSZ_CHECK(!ds_ids.empty(), op, "graph ", graph_id, ": no ds_ids");
    std::vector<ParamEntry*> params;
    std::vector<std::optional<at::ScalarType>> types;
    groupOf(ex, graph_id, ds_ids, dtypes, op, params, types);
    for (const ParamEntry* p : params) {
        DSZ_CHECK(p->persistent, op, "ds_id ", p->ds_id, " of graph ", graph_id,
                  " is not persistent (set_persistent was not called for it, or declined it): "
                  "its gathered copy would never be released");
    }
    if (config_.sync_before_allgather) { device_->synchronizeDevice(); }
    gatherer_.prefetch(params, types, op);  // one group for those without a valid copy
    std::vector<at::Tensor> out;
    out.reserve(params.size());
    for (size_t i = 0; i < params.size(); ++i) {
        out.push_back(gatherer_.gatherKept(*params[i], types[i], op));
        gatherer_.wait(*params[i]);
    }
    if (config_.sync_after_allgather) { device_->synchronizeDevice(); }
    return out;
}

void Runtime::reduceGrad(int64_t graph_id, int64_t ds_id, const at::Tensor& grad)
{
    DSZ_LOCK;
    const char* op = "reduce_grad";
    GraphExecutor& ex = executor(graph_id, op);
    ParamEntry& p = member(ex, ds_id, op);
    if (profiling_) { return; }  // the profiler runs the graph without reducing
    if (ex.stage() == ZeroStage::Z1) {
        // ZeRO-1 keeps the gradient for later: checked now (the reducer checks what it is given).
        GradReducer::requireReducible(p, op);
        GradReducer::requireGradient(p, grad, op);
    }
    if (config_.sync_before_reduce) { device_->synchronizeDevice(); }
    if (ex.stage() == ZeroStage::Z1) {
        // ZeRO-1 reduces once per accumulation window, the local sum of its gradients.
        ex.accumulateLocal(ds_id, grad);
        if (updating_) { reducer_.add(p, ex.takeLocal(ds_id), op); }
    } else {
        reducer_.add(p, grad, op);
    }
    if (config_.sync_after_reduce) { device_->synchronizeDevice(); }
}

void Runtime::reduceGrads(int64_t graph_id, const std::vector<int64_t>& ds_ids,
                          const std::vector<at::Tensor>& grads)
{
    DSZ_LOCK;
    const char* op = "reduce_grads";
    DSZ_CHECK(ds_ids.size() == grads.size(), op, "graph ", graph_id, ": ", grads.size(),
              " gradients but ", ds_ids.size(), " ids");
    DSZ_CHECK(!ds_ids.empty(), op, "graph ", graph_id, ": no ds_ids");
    GraphExecutor& ex = executor(graph_id, op);
    std::vector<ParamEntry*> params;
    params.reserve(ds_ids.size());
    for (int64_t ds_id : ds_ids) { params.push_back(&member(ex, ds_id, op)); }
    if (profiling_) { return; }  // the profiler runs the graph without reducing
    if (ex.stage() == ZeroStage::Z1) {
        // Every gradient checked before the first is kept (the reducer checks the group it is
        // given before it copies any).
        for (size_t i = 0; i < params.size(); ++i) {
            GradReducer::requireReducible(*params[i], op);
            GradReducer::requireGradient(*params[i], grads[i], op);
        }
    }
    if (config_.sync_before_reduce) { device_->synchronizeDevice(); }
    if (ex.stage() == ZeroStage::Z1) {
        for (size_t i = 0; i < params.size(); ++i) {
            ex.accumulateLocal(ds_ids[i], grads[i]);
            if (updating_) { reducer_.add(*params[i], ex.takeLocal(ds_ids[i]), op); }
        }
    } else {
        reducer_.addGroup(params, grads, op);
    }
    if (config_.sync_after_reduce) { device_->synchronizeDevice(); }
}

void Runtime::endBackward(int64_t graph_id, bool release_reduce_buckets)
{
    DSZ_LOCK;
    const char* op = "end_backward";
    GraphExecutor& ex = executor(graph_id, op);
    // DeepSpeed calls start_backward from the engine's backward prologue, before any backward
    // graph runs. The one order that reaches end_backward without it is DeepCompile's profiler:
    // when torch compiles a backward graph ahead of time (symbolic sizes saved for backward), the
    // profiler runs it, end_backward included, during the first forward, with profiling on. That
    // is accepted (reduce_grad queues nothing while profiling). Any other end_backward before the
    // first start_backward means the prologue never ran: the accumulation window would never
    // close, and later backwards would add to gradients the optimizer already consumed.
    const size_t queued = reducer_.pending();
    DSZ_CHECK(backward_started_ || (profiling_ && queued == 0), op, "graph_id ", graph_id,
              ": no backward has begun on this runtime (start_backward was not called since "
              "init; profiling ", profiling_ ? "on" : "off", ", ", queued,
              " gradients queued). Call start_backward(update) before the backward graphs run, "
              "as DeepSpeed's backward prologue does");
    reducer_.flushAll();
    // The optimizer step reads the grad buffers next, in stream order after the backward: the
    // compute stream waits for the reductions, the host goes on to launch the step.
    reducer_.joinCompute();
    if (release_reduce_buckets) { reducer_.releaseBuffers(); }
    if (updating_) {
        for (int64_t id : ex.ids()) {
            if (registry_.contains(id)) { Gatherer::invalidateAfterStep(registry_.get(id, op)); }
        }
    }
    auto it = offloads_.find(resolve(graph_id));
    if (it != offloads_.end()) { it->second.releaseReloaded(); }
}

void Runtime::freeTensors(const std::vector<at::Tensor>& tensors)
{
    DSZ_LOCK;
    if (profiling_) { return; }
    const c10::Device dev = device_->computeDevice();
    for (const at::Tensor& t : tensors) {
        if (!t.defined() || t.device() != dev || t.numel() <= config_.free_activation_threshold ||
            !hasData(t)) {
            continue;
        }
        device_->recordStream(t, StreamRole::Compute);
        const_cast<at::Tensor&>(t).set_data(at::empty({0}, t.options()));
    }
}

ActivationOffload& Runtime::offloadFor(int64_t graph_id, const char* op)
{
    executor(graph_id, op);
    graph_id = resolve(graph_id);
    auto it = offloads_.find(graph_id);
    if (it == offloads_.end()) {
        it = offloads_
                 .emplace(std::piecewise_construct, std::forward_as_tuple(graph_id),
                          std::forward_as_tuple(*device_, config_.offload_activation_pin_memory))
                 .first;
    }
    return it->second;
}

at::Tensor Runtime::offloadTensor(const at::Tensor& t, int64_t graph_id, int64_t id)
{
    DSZ_LOCK;
    return offloadFor(graph_id, "offload_tensor").offload(t, id, "offload_tensor");
}

at::Tensor Runtime::reloadTensor(int64_t graph_id, int64_t id)
{
    DSZ_LOCK;
    return offloadFor(graph_id, "reload_tensor").reload(id, "reload_tensor");
}

at::Tensor Runtime::waitOffload(int64_t graph_id, int64_t id)
{
    DSZ_LOCK;
    return offloadFor(graph_id, "wait_offload").waitOffload(id, "wait_offload");
}

at::Tensor Runtime::waitReload(const at::Tensor& t, int64_t graph_id, int64_t id)
{
    DSZ_LOCK;
    return offloadFor(graph_id, "wait_reload").waitReload(id, t, profiling_, "wait_reload");
}

void Runtime::offloadParameter(int64_t graph_id, int64_t ds_id)
{
    DSZ_LOCK;
    const char* op = "offload_parameter";
    ParamEntry& p = member(executor(graph_id, op), ds_id, op);
    if (!p.reloaded.defined()) { return; }
    auto ready = device_->newEvent();
    ready->record(StreamRole::Compute);
    ready->block(StreamRole::Offload);
    {
        auto scope = device_->use(StreamRole::Offload);
        p.shard.copy_(p.reloaded, /*non_blocking=*/true);
        device_->recordStream(p.reloaded, StreamRole::Offload);
    }
    p.reloaded = at::Tensor();
    p.reload_done.reset();
    p.offload_done = device_->newEvent();
    p.offload_done->record(StreamRole::Offload);
}

void Runtime::reloadParameter(int64_t graph_id, int64_t ds_id)
{
    DSZ_LOCK;
    const char* op = "reload_parameter";
    ParamEntry& p = member(executor(graph_id, op), ds_id, op);
    const c10::Device dev = device_->computeDevice();
    if (p.shard.device() == dev) { return; }  // resident already
    DSZ_CHECK(hasData(p.shard), op, "the shard of ds_id ", p.ds_id,
              " has no data (its storage was freed after registration)");
    auto ready = device_->newEvent();
    ready->record(StreamRole::Compute);
    ready->block(StreamRole::Reload);
    {
        auto scope = device_->use(StreamRole::Reload);
        p.reloaded = p.shard.to(dev, /*non_blocking=*/true);
    }
    p.offload_done.reset();
    p.reload_done = device_->newEvent();
    p.reload_done->record(StreamRole::Reload);
}

void Runtime::requireParam(int64_t ds_id, const char* op)
{
    DSZ_LOCK;
    registry_.get(ds_id, op);
}

at::Tensor Runtime::gatheredMeta(int64_t ds_id, std::optional<at::ScalarType> dtype,
                                 const char* op)
{
    DSZ_LOCK;
    return Gatherer::metaOf(registry_.get(ds_id, op), dtype);
}

// ---------------------------------------------------------------- introspection

CommStats Runtime::stats()
{
    DSZ_LOCK;
    return stats_;
}

void Runtime::resetStats()
{
    DSZ_LOCK;
    stats_ = CommStats();
}

Runtime::ParamState Runtime::paramState(int64_t ds_id)
{
    DSZ_LOCK;
    const ParamEntry& p = registry_.get(ds_id, "param_state");
    return ParamState{p.frozen,
                      p.persistent,
                      p.partitioned,
                      p.has_gathered && p.gathered.defined(),
                      p.valid,
                      p.grad_accumulated,
                      p.numel,
                      p.shard.numel(),
                      p.grad_buffer.defined() ? p.grad_buffer.numel() : 0};
}

std::vector<int64_t> Runtime::graphIds()
{
    DSZ_LOCK;
    std::vector<int64_t> ids;
    for (const auto& [id, ex] : executors_) { ids.push_back(id); }
    return ids;
}

size_t Runtime::pendingGradients()
{
    DSZ_LOCK;
    return reducer_.pending();
}

// ---------------------------------------------------------------- the process-wide instance

namespace current_runtime {
namespace {
// Deliberately never destroyed by static destructors: at exit a process group torn down after its
// backend can abort the process. cleanup() (and an atexit hook of the module) ends the runtime.
std::mutex& slotMutex()
{
    static auto* m = new std::mutex();
    return *m;
}
std::shared_ptr<Runtime>& slot()
{
    static auto* s = new std::shared_ptr<Runtime>();
    return *s;
}
RuntimeDefaults& defaultsSlot()  // guarded by slotMutex()
{
    static auto* d = new RuntimeDefaults();
    return *d;
}

// Swaps the slot's runtime for `next` and returns the previous one, which the caller drops
// outside the slot's lock (its destructor may wait on a communicator).
std::shared_ptr<Runtime> exchange(std::shared_ptr<Runtime> next)
{
    std::lock_guard<std::mutex> guard(slotMutex());
    std::swap(slot(), next);
    return next;
}
}  // namespace

std::shared_ptr<Runtime> get(const char* op)
{
    std::shared_ptr<Runtime> rt = tryGet();
    DSZ_CHECK(rt != nullptr, op,
              "the runtime is not initialized: call init(process_group, config, bucket_size) "
              "first (DeepSpeed does this in engine.compile()), or it was ended by cleanup()");
    return rt;
}

std::shared_ptr<Runtime> tryGet()
{
    std::lock_guard<std::mutex> guard(slotMutex());
    return slot();
}

void replace(std::shared_ptr<Runtime> runtime)
{
    destroy();
    exchange(std::move(runtime));  // a runtime installed meanwhile by another thread ends here
}

void destroy() { exchange(nullptr); }

void setDefaults(const RuntimeDefaults& defaults, const char* op)
{
    checkedBudget(defaults.persistence_budget_bytes, op);
    std::lock_guard<std::mutex> guard(slotMutex());
    defaultsSlot() = defaults;
}

RuntimeDefaults defaults()
{
    std::lock_guard<std::mutex> guard(slotMutex());
    return defaultsSlot();
}

}  // namespace current_runtime

}  // namespace dsz
