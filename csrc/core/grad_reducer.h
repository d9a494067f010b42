// Gradient reduction through per-dtype, optionally double-buffered buckets. A ZeRO-3 gradient
// takes a slot of the padded length (world_size * ceil(numel / world_size)), its padding zeroed,
// and is reduce-scattered into this rank's shard of the grad buffer; a ZeRO-1/2 gradient is
// all-reduced and its partition copied out. Values are averaged over ranks (pre-divided, summed).
// No collective is ever issued for a frozen param or one without a large enough buffer: such a
// gradient raises an error naming the ds_id instead of being dropped.
#pragma once

#include <ATen/core/Tensor.h>

#include <map>
#include <memory>
#include <vector>

#include "comm/collectives.h"
#include "core/bucket.h"
#include "core/param_registry.h"
#include "core/stats.h"
#include "device/device.h"

namespace dsz {

class GradReducer {
public:
    GradReducer(ParamRegistry& registry,
                Collectives& comm,
                DeviceBackend& device,
                CommStats& stats,
                int64_t bucket_capacity,
                bool double_buffer);

    // Checks that `p` may receive a reduced gradient; throws naming `op` and the id otherwise.
    static void requireReducible(const ParamEntry& p, const char* op);
    // Checks a gradient for `p` (defined, floating point, p's numel, readable); throws naming
    // `op` and the id otherwise.
    static void requireGradient(const ParamEntry& p, const at::Tensor& grad, const char* op);

    // Validates `grad` and queues it; flushes the bucket first when it is full.
    void add(ParamEntry& p, const at::Tensor& grad, const char* op);
    // add() for each (params[i], grads[i]): all validated before any is queued, and the copy
    // stream waits for the compute stream once for the group.
    void addGroup(const std::vector<ParamEntry*>& params, const std::vector<at::Tensor>& grads,
                  const char* op);
    // The dtypes a gradient is reduced in (every backend's reduce-scatter takes them).
    static bool reducibleDtype(at::ScalarType dtype);
    // The bucket elements the queued gradient of ds_id takes, or -1 when none is queued.
    int64_t queuedSlotNumel(int64_t ds_id) const;
    void flushAll();
    // Makes later work on the compute stream wait for every reduction issued so far (their
    // writes into the grad buffers); the host does not wait.
    void joinCompute();
    // Frees bucket memory (nothing may be queued).
    void releaseBuffers();
    size_t pending() const;
    int64_t bucketCapacity() const { return capacity_; }

private:
    struct Task {
        int64_t ds_id;
        at::Tensor slot;    // the bucket slice holding the (padded) gradient
    };
    struct PerDtype {
        std::vector<std::unique_ptr<ReduceBucket>> buckets;  // 1 or 2
        size_t current = 0;
        std::vector<Task> tasks;
        ReduceBucket& bucket() { return *buckets[current]; }
    };

    // Bucket writes queued by addGroup, issued together on the copy stream.
    struct PendingCopies {
        std::vector<at::Tensor> dst;      // slot regions
        std::vector<at::Tensor> src;      // flat gradients
        std::vector<at::Tensor> padding;  // slot tails past the gradient, zeroed
    };

    PerDtype& stateFor(at::ScalarType dtype, c10::Device device);
    void issue(PendingCopies& pending);
    void flush(at::ScalarType dtype, PerDtype& state);
    void discard(PerDtype& state);
    // Raises stats_.reduce_bucket_bytes to the bucket memory allocated now, if higher.
    void noteBucketMemory();

    ParamRegistry& registry_;
    Collectives& comm_;
    DeviceBackend& device_;
    CommStats& stats_;
    int64_t capacity_;
    bool double_buffer_;
    std::map<at::ScalarType, PerDtype> per_dtype_;
    std::shared_ptr<Event> compute_ready_;
    std::shared_ptr<Event> copies_done_;
    std::shared_ptr<Event> reduced_;
};

}  // namespace dsz
