// Counters of the collectives the runtime issued (per call, not per NCCL kernel). At world size 1
// a gradient's reduce-scatter or all-reduce is counted as one, though the reducer issues no
// collective there: the sum over one rank is the gradient itself.
#pragma once

#include <cstdint>

namespace dsz {

struct CommStats {
    int64_t allgather_calls = 0;
    int64_t allgather_bytes = 0;  // bytes received per rank (the padded gathered buffer)
    int64_t reduce_scatter_calls = 0;
    int64_t reduce_scatter_bytes = 0;  // bytes sent per rank (the padded bucket slot)
    int64_t allreduce_calls = 0;
    int64_t allreduce_bytes = 0;
    int64_t bucket_flushes = 0;
    int64_t reduce_bucket_bytes = 0;  // the most reduce-bucket memory allocated at once
};

}  // namespace dsz
