// ZeRO-3 parameter gathering: allgather into a padded buffer, prefetch in one group, wait,
// free at the last use, persistence, and invalidation after an optimizer step.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <vector>

#include "comm/collectives.h"
#include "core/param_registry.h"
#include "core/stats.h"
#include "device/device.h"

namespace dsz {

// Bytes every gathered buffer handed out is aligned to: inductor's generated code asserts it of
// a custom op's outputs (GPU_ALIGN_BYTES) and its kernels rely on it.
constexpr std::uintptr_t kGatherAlignment = 16;
bool isGatherAligned(const at::Tensor& t);

class Gatherer {
public:
    Gatherer(Collectives& comm, DeviceBackend& device, CommStats& stats);

    // The full parameter (true numel, original shape) in `dtype` (default: the shard's dtype).
    // Issues an allgather unless a valid gathered copy exists. The result may still be in
    // flight on the allgather stream: wait() makes the compute stream wait for it.
    at::Tensor gather(ParamEntry& p, std::optional<at::ScalarType> dtype, const char* op);
    // gather(), for a param whose copy is kept: the full view of a valid copy in `dtype` is made
    // once and handed out again on later calls (no dispatcher call), until the copy changes.
    at::Tensor gatherKept(ParamEntry& p, std::optional<at::ScalarType> dtype, const char* op);
    // Starts gathers of every listed param that has no valid copy, in one collective group.
    void prefetch(const std::vector<ParamEntry*>& params,
                  const std::vector<std::optional<at::ScalarType>>& dtypes,
                  const char* op);
    void wait(ParamEntry& p);
    // Frees the gathered copy in place (every view of it loses its storage).
    void free(ParamEntry& p, const char* op);
    // Forgets the gathered copy without freeing it (the profiler still holds it).
    void forget(ParamEntry& p, bool keep_placeholder);
    // After an optimizer step the values changed: the next gather must refresh the copy.
    // Frozen params never change, so their copies stay valid.
    static void invalidateAfterStep(ParamEntry& p);

    // On one rank, a gather in the shard's own dtype of a shard that sits contiguous and
    // aligned (kGatherAlignment) on the compute device needs no copy: the gathered param is the
    // shard's memory, under a storage of its own. Such a gather issues no collective, takes no
    // memory, and its release leaves the shard alone.
    bool aliasesShard(const ParamEntry& p, at::ScalarType dtype) const;

    // Full-shape metadata of the gathered param (for the Meta kernel).
    static at::Tensor metaOf(const ParamEntry& p, std::optional<at::ScalarType> dtype);

private:
    at::Tensor prepareBuffer(ParamEntry& p, at::ScalarType dtype);
    void useShard(ParamEntry& p);  // the gathered param is the shard (aliasesShard)
    void launch(ParamEntry& p, const at::Tensor& buffer);  // gatherInto, and keeps the copy
    void gatherInto(ParamEntry& p, const at::Tensor& buffer);
    at::Tensor shardForGather(ParamEntry& p, at::ScalarType dtype);

    Collectives& comm_;
    DeviceBackend& device_;
    CommStats& stats_;
    std::shared_ptr<Event> compute_ready_;
};

}  // namespace dsz
