// Every parameter the runtime knows, keyed by DeepSpeed's ds_id: its shard, its gradient buffer,
// the frozen and persistent flags, and the state of its gathered (full) copy.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <vector>

#include "core/padding.h"
#include "device/device.h"

namespace dsz {

struct ParamEntry {
    int64_t ds_id = -1;
    std::vector<int64_t> shape;  // full (unpartitioned) shape
    int64_t numel = 0;
    ShardLayout layout;          // ZeRO-3 partition arithmetic at the current world size

    // ZeRO-3: this rank's partition (layout.per_rank elements). ZeRO-1/2: the full parameter.
    at::Tensor shard;
    // Where reduced gradients land. Undefined or empty when the param has none.
    at::Tensor grad_buffer;
    int64_t grad_offset = 0;     // ZeRO-1/2: first element of this rank's partition in the param
    bool partitioned = true;     // true for ZeRO-3 params (reduce-scatter), false for ZeRO-1/2
    bool persistent = false;     // stays gathered between uses
    bool frozen = false;         // requires_grad=False: never reduced
    std::optional<at::ScalarType> expected_grad_dtype;

    // Gathered copy (ZeRO-3). `gathered` is the padded flat buffer; a profiling placeholder is an
    // entry with an undefined tensor. `valid` means the buffer holds the current values (or a
    // gather into it is in flight and `gather_done` marks its end).
    bool has_gathered = false;
    at::Tensor gathered;
    bool valid = false;
    std::shared_ptr<Event> gather_done;
    // The full-shape view of `gathered` that Gatherer::gatherKept last returned (made once per
    // buffer for a param kept gathered); dropped with the buffer.
    at::Tensor full_view;
    // On one rank `gathered` may be the shard itself (Gatherer::aliasesShard): releasing it must
    // then only forget it, never free its storage.
    bool gathered_is_shard = false;

    // Set once a reduced gradient has been written into grad_buffer in this accumulation window:
    // later ones are added, the first one overwrites.
    bool grad_accumulated = false;

    // Parameter offload (offload_parameter / reload_parameter).
    at::Tensor reloaded;
    std::shared_ptr<Event> offload_done;
    std::shared_ptr<Event> reload_done;

    bool hasGradBuffer() const { return grad_buffer.defined() && grad_buffer.numel() > 0; }
    // Elements of the gradient buffer a reduced gradient needs.
    int64_t requiredGradNumel() const { return partitioned ? layout.per_rank : 0; }
    // Bytes of a full padded copy in the shard's dtype (what keeping one gathered takes).
    int64_t paddedShardBytes() const
    {
        return layout.padded * static_cast<int64_t>(shard.element_size());
    }
    // Elements its gradient takes in a reduce bucket (ZeRO-3: the padded length).
    int64_t slotNumel() const { return partitioned ? layout.padded : numel; }
};

class ParamRegistry {
public:
    // Adds the entry, or replaces an existing one with the same ds_id (its gathered copy is
    // dropped with it). Returns true when it replaced one.
    bool put(ParamEntry entry);

    bool contains(int64_t ds_id) const { return params_.count(ds_id) != 0; }
    // Throws a RuntimeError naming `op` and the id when it is unknown.
    ParamEntry& get(int64_t ds_id, const char* op);
    const ParamEntry& get(int64_t ds_id, const char* op) const;

    size_t size() const { return params_.size(); }
    // The slots (padded for ZeRO-3) of every param that is not frozen: what one backward's
    // gradients take in a reduce bucket when each trainable param is reduced once.
    int64_t reducibleSlotNumel() const;
    std::map<int64_t, ParamEntry>& entries() { return params_; }
    const std::map<int64_t, ParamEntry>& entries() const { return params_; }
    void clear() { params_.clear(); }

private:
    std::map<int64_t, ParamEntry> params_;
};

}  // namespace dsz
