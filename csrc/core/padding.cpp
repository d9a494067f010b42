#include "core/padding.h"

#include <algorithm>

#include "core/check.h"

namespace dsz {

ShardLayout ShardLayout::of(int64_t numel, int64_t world_size, const char* op)
{
    DSZ_CHECK(numel >= 0, op, "numel must be >= 0, got ", numel);
    DSZ_CHECK(world_size >= 1, op, "world_size must be >= 1, got ", world_size);
    ShardLayout s;
    s.numel = numel;
    s.world_size = world_size;
    s.per_rank = (numel + world_size - 1) / world_size;
    s.padded = s.per_rank * world_size;
    return s;
}

int64_t ShardLayout::validInShard(int64_t rank) const
{
    const int64_t begin = shardBegin(rank);
    return std::max<int64_t>(0, std::min(per_rank, numel - begin));
}

}  // namespace dsz
