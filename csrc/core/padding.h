// Shard arithmetic for ZeRO-3 partitions: a parameter of `numel` elements is split over
// `world_size` ranks into equal shards of ceil(numel / world_size) elements; the last shards carry
// zero padding. Collectives always move the padded length, never numel.
#pragma once

#include <cstdint>

namespace dsz {

struct ShardLayout {
    int64_t numel = 0;       // elements of the full (unpartitioned) parameter
    int64_t world_size = 1;  // ranks in the data-parallel group
    int64_t per_rank = 0;    // elements of one shard, padding included
    int64_t padded = 0;      // world_size * per_rank

    // Throws (with `op` in the message) on a negative numel or a world size below 1.
    static ShardLayout of(int64_t numel, int64_t world_size, const char* op = "shard_layout");

    int64_t padding() const { return padded - numel; }
    // First element of rank r's shard in the padded flat tensor.
    int64_t shardBegin(int64_t rank) const { return rank * per_rank; }
    // Elements of rank r's shard that hold real data (the rest is padding).
    int64_t validInShard(int64_t rank) const;
};

}  // namespace dsz
