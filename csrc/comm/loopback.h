// An in-process "world" of N ranks, each a thread, for the native unit tests. Collectives
// rendezvous through shared memory; inside a group they are deferred to groupEnd() like NCCL's.
#pragma once

#include <condition_variable>
#include <memory>
#include <mutex>
#include <vector>

#include "comm/collectives.h"

namespace dsz {

class LoopbackWorld {
public:
    explicit LoopbackWorld(int64_t size);
    int64_t size() const { return size_; }
    // Blocks until every rank contributed, then returns all contributions in rank order.
    std::vector<at::Tensor> exchange(int64_t rank, const at::Tensor& contribution);
    // Collectives issued by all ranks together (each rank's call counts once).
    int64_t issued() const;

private:
    int64_t size_;
    mutable std::mutex mu_;
    std::condition_variable cv_;
    std::vector<at::Tensor> slots_;
    std::vector<at::Tensor> results_;
    int64_t arrived_ = 0;
    int64_t consumed_ = 0;
    int64_t generation_ = 0;
    int64_t issued_ = 0;
    bool draining_ = false;
};

std::unique_ptr<Collectives> makeLoopbackCollectives(std::shared_ptr<LoopbackWorld> world,
                                                     int64_t rank);

}  // namespace dsz
