#include "core/grad_reducer.h"

#include <ATen/ops/_foreach_copy.h>
#include <ATen/ops/_foreach_zero.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <exception>
#include <string>
#include <unordered_set>

#include "core/check.h"

namespace dsz {

GradReducer::GradReducer(ParamRegistry& registry,
                         Collectives& comm,
                         DeviceBackend& device,
                         CommStats& stats,
                         int64_t bucket_capacity,
                         bool double_buffer)
    : registry_(registry),
      comm_(comm),
      device_(device),
      stats_(stats),
      capacity_(bucket_capacity),
      double_buffer_(double_buffer),
      compute_ready_(device.newEvent()),
      copies_done_(device.newEvent()),
      reduced_(device.newEvent())
{
    DSZ_CHECK(bucket_capacity >= 1, "init", "initial_reduce_bucket_size must be >= 1, got ",
              bucket_capacity);
}

void GradReducer::requireReducible(const ParamEntry& p, const char* op)
{
    DSZ_CHECK(!p.frozen, op, "ds_id ", p.ds_id,
              " is frozen (requires_grad=False or set_param_frozen) but received a gradient; "
              "no collective was issued. Unfreeze it with set_param_frozen(", p.ds_id,
              ", False) and give it a grad buffer (re-register it), or keep it out of the loss");
    if (p.partitioned) {
        const int64_t have = p.grad_buffer.defined() ? p.grad_buffer.numel() : 0;
        DSZ_CHECK(have >= p.requiredGradNumel(), op, "ds_id ", p.ds_id,
                  " has a grad buffer of ", have, " elements but its shard needs ",
                  p.requiredGradNumel(), " (ceil(", p.numel, " / ", p.layout.world_size,
                  ")); a param registered frozen (empty buffer) and unfrozen later must be "
                  "registered again with a grad buffer");
    }
    DSZ_CHECK(!p.hasGradBuffer() || hasData(p.grad_buffer), op, "the grad buffer of ds_id ",
              p.ds_id, " has no data (its storage was freed after registration)");
}

bool GradReducer::reducibleDtype(at::ScalarType dtype)
{
    return dtype == at::kFloat || dtype == at::kDouble || dtype == at::kHalf ||
           dtype == at::kBFloat16;
}

int64_t GradReducer::queuedSlotNumel(int64_t ds_id) const
{
    for (const auto& [dtype, state] : per_dtype_) {
        for (const Task& t : state.tasks) {
            if (t.ds_id == ds_id) { return t.slot.numel(); }
        }
    }
    return -1;
}

GradReducer::PerDtype& GradReducer::stateFor(at::ScalarType dtype, c10::Device device)
{
    auto it = per_dtype_.find(dtype);
    if (it != per_dtype_.end()) { return it->second; }
    PerDtype state;
    // No bucket larger than all reducible gradients together: with frozen params (LoRA) the
    // configured size (DeepSpeed's reduce_bucket_size, 5e8 elements by default) is mostly never
    // written. A param registered or unfrozen later still fits: a full bucket flushes and an
    // empty one grows; the buckets are sized again after the next release.
    const int64_t capacity =
        std::max<int64_t>(1, std::min(capacity_, registry_.reducibleSlotNumel()));
    const int n = double_buffer_ ? 2 : 1;
    for (int i = 0; i < n; ++i) {
        state.buckets.push_back(std::make_unique<ReduceBucket>(capacity, dtype, device));
        state.buckets.back()->drained = device_.newEvent();
    }
    return per_dtype_.emplace(dtype, std::move(state)).first->second;
}

void GradReducer::requireGradient(const ParamEntry& p, const at::Tensor& grad, const char* op)
{
    DSZ_CHECK(grad.defined(), op, "undefined gradient for ds_id ", p.ds_id);
    DSZ_CHECK(at::isFloatingType(grad.scalar_type()), op, "gradient of ds_id ", p.ds_id,
              " must be floating point, got ", grad.scalar_type());
    const at::ScalarType reduced = p.expected_grad_dtype.value_or(grad.scalar_type());
    DSZ_CHECK(reducibleDtype(reduced), op, "gradient of ds_id ", p.ds_id, " would be reduced in ",
              reduced, ", which the collectives do not take (Float, Double, Half, BFloat16)");
    DSZ_CHECK(grad.numel() == p.numel, op, "gradient of ds_id ", p.ds_id, " has ", grad.numel(),
              " elements, the param has ", p.numel);
    DSZ_CHECK(hasData(grad), op, "gradient of ds_id ", p.ds_id, " (shape ", grad.sizes(),
              ") has no data (its storage was freed, e.g. by release_param)");
}

void GradReducer::add(ParamEntry& p, const at::Tensor& grad, const char* op)
{
    addGroup({&p}, {grad}, op);
}

void GradReducer::addGroup(const std::vector<ParamEntry*>& params,
                           const std::vector<at::Tensor>& grads, const char* op)
{
    DSZ_CHECK(params.size() == grads.size(), op, params.size(), " params but ", grads.size(),
              " gradients");
    for (size_t i = 0; i < params.size(); ++i) {
        requireReducible(*params[i], op);
        requireGradient(*params[i], grads[i], op);
    }
    // Conversions run on the compute stream, before the point the copies wait for.
    std::vector<at::Tensor> converted;
    converted.reserve(grads.size());
    for (size_t i = 0; i < grads.size(); ++i) {
        at::Tensor grad = grads[i].detach();
        const ParamEntry& p = *params[i];
        if (p.expected_grad_dtype && grad.scalar_type() != *p.expected_grad_dtype) {
            grad = grad.to(*p.expected_grad_dtype);
        }
        converted.push_back(std::move(grad));
    }
    // The copies may start once the gradients are computed and a bucket's last flush has read
    // it: the copy stream waits once for the group, and once for each bucket it writes (again
    // after a flush, which drains it anew). The copies into one bucket go out as one batched
    // (foreach) copy, issued before that bucket flushes.
    compute_ready_->record(StreamRole::Compute);
    compute_ready_->block(StreamRole::Copy);
    std::vector<const ReduceBucket*> waited;
    PendingCopies pending;
    try {
        for (size_t i = 0; i < params.size(); ++i) {
            ParamEntry& p = *params[i];
            const at::Tensor& grad = converted[i];
            const at::ScalarType dtype = grad.scalar_type();
            const int64_t slot_n = p.slotNumel();
            // A trainable param without elements: nothing to reduce, nothing to write.
            if (slot_n == 0) { continue; }

            PerDtype& state = stateFor(dtype, grad.device());
            if (state.bucket().cursor().needsFlushFor(slot_n)) {
                issue(pending);
                flush(dtype, state);
                waited.clear();
            }
            ReduceBucket& bucket = state.bucket();
            if (std::find(waited.begin(), waited.end(), &bucket) == waited.end()) {
                bucket.drained->block(StreamRole::Copy);
                waited.push_back(&bucket);
            }
            at::Tensor slot;
            {
                auto scope = device_.use(StreamRole::Copy);  // a growing bucket allocates here
                slot = bucket.take(slot_n);
            }
            noteBucketMemory();
            pending.dst.push_back(slot.narrow(0, 0, p.numel));
            pending.src.push_back(grad.reshape({-1}));
            if (slot_n > p.numel) {
                pending.padding.push_back(slot.narrow(0, p.numel, slot_n - p.numel));
            }
            state.tasks.push_back(Task{p.ds_id, slot});
        }
    } catch (...) {
        // The gradients queued before the failure still go into their slots: a later flush
        // reduces them. A second failure here is dropped for the first one, which is rethrown.
        try {
            issue(pending);
        } catch (...) {
        }
        throw;
    }
    issue(pending);
}

void GradReducer::issue(PendingCopies& pending)
{
    if (pending.dst.empty()) { return; }
    {
        auto scope = device_.use(StreamRole::Copy);
        at::_foreach_copy_(pending.dst, pending.src, /*non_blocking=*/true);
        if (!pending.padding.empty()) { at::_foreach_zero_(pending.padding); }
        // The gradients' memory may be reused only after the copy stream has read it.
        for (const at::Tensor& src : pending.src) { device_.recordStream(src, StreamRole::Copy); }
    }
    pending = PendingCopies{};
}

void GradReducer::noteBucketMemory()
{
    int64_t bytes = 0;
    for (const auto& [dtype, state] : per_dtype_) {
        for (const auto& b : state.buckets) { bytes += b->allocatedBytes(); }
    }
    stats_.reduce_bucket_bytes = std::max(stats_.reduce_bucket_bytes, bytes);
}

void GradReducer::discard(PerDtype& state)
{
    state.tasks.clear();
    state.bucket().cursor().reset();
}

void GradReducer::flush(at::ScalarType dtype, PerDtype& state)
{
    if (state.tasks.empty()) { return; }
    // Check every task before the first collective: a refusal must not leave ranks mid-group.
    // A refused gradient is left out and named; the others of the bucket are still reduced.
    const char* op = "reduce_grad (bucket flush)";
    std::vector<ParamEntry*> params;
    std::vector<Task> kept;
    std::string refused;
    for (Task& t : state.tasks) {
        try {
            ParamEntry& p = registry_.get(t.ds_id, op);
            requireReducible(p, op);
            params.push_back(&p);
            kept.push_back(std::move(t));
        } catch (const c10::Error& e) {
            refused += (refused.empty() ? "" : "; ") + std::string(e.what_without_backtrace());
        }
    }
    state.tasks = std::move(kept);
    if (state.tasks.empty()) {
        discard(state);
        DSZ_CHECK(refused.empty(), op, "gradients refused, not reduced: ", refused);
        return;
    }

    const int64_t ws = comm_.worldSize();
    ReduceBucket& bucket = state.bucket();
    copies_done_->record(StreamRole::Copy);
    copies_done_->block(StreamRole::ReduceScatter);
    {
        auto scope = device_.use(StreamRole::ReduceScatter);
        at::Tensor region = bucket.usedRegion();
        if (ws > 1) { region.div_(static_cast<double>(ws)); }

        // Receive directly into the grad buffer unless the result must be added or converted.
        std::vector<at::Tensor> recv(params.size());
        std::vector<bool> staged(params.size(), false);
        std::unordered_set<int64_t> receiving;  // params whose first gradient lands directly
        int64_t staged_numel = 0;
        for (size_t i = 0; i < params.size(); ++i) {
            const ParamEntry& p = *params[i];
            if (!p.partitioned) { continue; }
            // A second gradient of the same param in one flush must be added, not received over
            // the first.
            staged[i] = p.grad_accumulated || p.grad_buffer.scalar_type() != dtype ||
                        !p.grad_buffer.is_contiguous() || !receiving.insert(p.ds_id).second;
            if (staged[i]) { staged_numel += p.layout.per_rank; }
        }
        at::Tensor staging;
        if (staged_numel > 0) {
            staging = at::empty({staged_numel},
                                at::TensorOptions().dtype(dtype).device(region.device()));
        }
        int64_t offset = 0;
        for (size_t i = 0; i < params.size(); ++i) {
            const ParamEntry& p = *params[i];
            if (!p.partitioned) { continue; }
            if (staged[i]) {
                recv[i] = staging.narrow(0, offset, p.layout.per_rank);
                offset += p.layout.per_rank;
            } else {
                recv[i] = p.grad_buffer.view({-1}).narrow(0, 0, p.layout.per_rank);
            }
        }

        // One rank's sum over ranks is its own slot: no collective is issued, the partitioned
        // gradients are received with one batched copy and the others read from their slots.
        const bool local = ws == 1;
        std::vector<at::Tensor> local_in;
        std::vector<at::Tensor> local_out;
        CommGroup group(comm_);
        for (size_t i = 0; i < params.size(); ++i) {
            const at::Tensor& slot = state.tasks[i].slot;
            const int64_t bytes = slot.numel() * static_cast<int64_t>(slot.element_size());
            if (params[i]->partitioned) {
                if (local) {
                    local_in.push_back(slot);
                    local_out.push_back(recv[i]);
                } else {
                    comm_.reduceScatterSum(slot, recv[i], params[i]->ds_id);
                }
                stats_.reduce_scatter_calls += 1;
                stats_.reduce_scatter_bytes += bytes;
            } else {
                if (!local) { comm_.allReduceSum(slot, params[i]->ds_id); }
                stats_.allreduce_calls += 1;
                stats_.allreduce_bytes += bytes;
            }
        }
        group.end();
        if (!local_in.empty()) { at::_foreach_copy_(local_out, local_in, /*non_blocking=*/true); }

        for (size_t i = 0; i < params.size(); ++i) {
            ParamEntry& p = *params[i];
            at::Tensor result;
            at::Tensor target;
            if (p.partitioned) {
                if (staged[i]) {
                    result = recv[i];
                    target = p.grad_buffer.view({-1}).narrow(0, 0, p.layout.per_rank);
                }
            } else if (p.hasGradBuffer()) {
                target = p.grad_buffer.view({-1});
                result = state.tasks[i].slot.narrow(0, p.grad_offset, target.numel());
            }
            if (target.defined()) {
                if (p.grad_accumulated) {
                    target.add_(result.to(target.scalar_type()));
                } else {
                    target.copy_(result, /*non_blocking=*/true);
                }
            }
            p.grad_accumulated = true;
        }
        if (staging.defined()) { device_.recordStream(staging, StreamRole::ReduceScatter); }
        device_.recordStream(region, StreamRole::ReduceScatter);
    }
    bucket.drained->record(StreamRole::ReduceScatter);
    stats_.bucket_flushes += 1;
    const size_t reduced = state.tasks.size();
    state.tasks.clear();
    bucket.cursor().reset();
    state.current = (state.current + 1) % state.buckets.size();
    DSZ_CHECK(refused.empty(), op, "gradients refused, not reduced: ", refused, " (the other ",
              reduced, " gradients of the bucket were reduced)");
}

void GradReducer::flushAll()
{
    // Every dtype's bucket is flushed even when one refuses a gradient; the first refusal is
    // reported after all.
    std::exception_ptr first;
    for (auto& [dtype, state] : per_dtype_) {
        try {
            flush(dtype, state);
        } catch (...) {
            if (!first) { first = std::current_exception(); }
        }
    }
    if (first) { std::rethrow_exception(first); }
}

void GradReducer::joinCompute()
{
    // Every bucket write is followed by its flush on the reduce-scatter stream, which waited for
    // the copy stream: that stream's last point covers both.
    reduced_->record(StreamRole::ReduceScatter);
    reduced_->block(StreamRole::Compute);
}

void GradReducer::releaseBuffers()
{
    DSZ_CHECK(pending() == 0, "end_backward", "cannot release reduce buckets with ", pending(),
              " gradients still queued");
    per_dtype_.clear();
}

size_t GradReducer::pending() const
{
    size_t n = 0;
    for (const auto& [dtype, state] : per_dtype_) { n += state.tasks.size(); }
    return n;
}

}  // namespace dsz
