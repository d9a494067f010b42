// Shared helpers of the native tests: simulated ranks (one thread and one Runtime per rank over a
// LoopbackWorld), deterministic parameter and gradient values, and error-message assertions.
#pragma once

#include <ATen/core/Tensor.h>
#include <gtest/gtest.h>

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "comm/loopback.h"
#include "core/padding.h"
#include "runtime.h"

namespace dsz::test {

// A config for tests: small buckets (the default would allocate 500M elements).
RuntimeConfig smallConfig(int64_t bucket_elements = 4096, bool double_buffer = true);

// A reusable barrier for the simulated ranks (to read LoopbackWorld::issued() while no rank can
// be inside a collective).
class Barrier {
public:
    explicit Barrier(int64_t n) : n_(n) {}
    void wait();

private:
    std::mutex mu_;
    std::condition_variable cv_;
    int64_t n_;
    int64_t arrived_ = 0;
    int64_t generation_ = 0;
};

using RankFn = std::function<void(int64_t rank, Runtime& rt)>;

// Runs fn on world->size() threads, rank r with its own Runtime over `world`. Exceptions that
// escape fn are reported as test failures naming the rank. If the ranks do not all finish (a
// collective that some rank never joined), the process exits with a message: a hang would
// otherwise only show as a ctest timeout.
void runRanks(const std::shared_ptr<LoopbackWorld>& world, const RuntimeConfig& config,
              const RankFn& fn);
// The same with a fresh world of `world_size` ranks.
void runRanks(int64_t world_size, const RuntimeConfig& config, const RankFn& fn);

// Values of the full (unpartitioned) parameter `ds_id`: distinct per element and per id, so a
// shard in the wrong place or of the wrong param shows. float32.
at::Tensor fullParam(int64_t ds_id, const std::vector<int64_t>& shape);
// Rank `rank`'s ZeRO-3 shard of `full` (layout.per_rank elements, zero padding at the end).
at::Tensor shardOf(const at::Tensor& full, const ShardLayout& layout, int64_t rank);
// The gradient rank `rank` produces for `ds_id` in backward pass `step`: differs per rank, id
// and step. float32, shape `shape`.
at::Tensor rankGrad(int64_t ds_id, const std::vector<int64_t>& shape, int64_t rank, int64_t step);
// Mean over ranks of rankGrad(ds_id, shape, r, step), flattened.
at::Tensor meanGrad(int64_t ds_id, const std::vector<int64_t>& shape, int64_t world_size,
                    int64_t step);

at::Tensor zerosF(int64_t n);
at::Tensor emptyF(int64_t n);
at::Tensor nanF(int64_t n);
int64_t numelOf(const std::vector<int64_t>& shape);
// ds_ids first, first + 1, ..., n of them.
std::vector<int64_t> idsFor(size_t n, int64_t first = 1);

// Registers a ZeRO-3 param on `rt` with its rank's shard of fullParam and (unless frozen) a
// zeroed grad buffer of exactly per_rank elements, which it returns (undefined when frozen).
at::Tensor registerZ3(Runtime& rt, int64_t ds_id, const std::vector<int64_t>& shape,
                      bool frozen = false, bool persistent = false);

// Success when fn throws a c10::Error whose message contains every one of `needles` (the op
// name and the id, typically). Never matches the full text.
::testing::AssertionResult throwsNaming(const std::function<void()>& fn,
                                        const std::vector<std::string>& needles);

}  // namespace dsz::test
