#include "comm/loopback.h"

#include <ATen/ATen.h>

#include <functional>

#include "core/check.h"

namespace dsz {

LoopbackWorld::LoopbackWorld(int64_t size) : size_(size), slots_(size)
{
    DSZ_CHECK(size >= 1, "loopback", "world size must be >= 1, got ", size);
}

std::vector<at::Tensor> LoopbackWorld::exchange(int64_t rank, const at::Tensor& contribution)
{
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return !draining_; });
    slots_[rank] = contribution.detach().clone();
    ++issued_;
    if (++arrived_ == size_) {
        results_ = slots_;
        draining_ = true;
        consumed_ = 0;
        ++generation_;
        cv_.notify_all();
    } else {
        const int64_t gen = generation_;
        cv_.wait(lock, [&] { return generation_ != gen; });
    }
    std::vector<at::Tensor> out = results_;
    if (++consumed_ == size_) {
        draining_ = false;
        arrived_ = 0;
        cv_.notify_all();
    }
    return out;
}

int64_t LoopbackWorld::issued() const
{
    std::lock_guard<std::mutex> lock(mu_);
    return issued_;
}

namespace {

class LoopbackCollectives final : public Collectives {
public:
    LoopbackCollectives(std::shared_ptr<LoopbackWorld> world, int64_t rank)
        : world_(std::move(world)), rank_(rank)
    {
        DSZ_CHECK(rank >= 0 && rank < world_->size(), "loopback", "rank ", rank,
                  " outside a world of ", world_->size());
    }
    const char* name() const override { return "loopback"; }
    int64_t rank() const override { return rank_; }
    int64_t worldSize() const override { return world_->size(); }

    void allGather(const at::Tensor& shard, const at::Tensor& out, int64_t ds_id) override
    {
        DSZ_CHECK(out.numel() == shard.numel() * worldSize(), "allgather", "ds_id ", ds_id,
                  ": output of ", out.numel(), " elements for a shard of ", shard.numel());
        // Real collectives (NCCL, c10d) do not convert: a dtype mismatch is the caller's bug.
        DSZ_CHECK(out.scalar_type() == shard.scalar_type(), "allgather", "ds_id ", ds_id,
                  ": output dtype ", out.scalar_type(), " differs from the shard's ",
                  shard.scalar_type());
        run([this, shard, out] {
            auto all = world_->exchange(rank_, shard.reshape({-1}));
            out.view({-1}).copy_(at::cat(all));
        });
    }

    void reduceScatterSum(const at::Tensor& in, const at::Tensor& out, int64_t ds_id) override
    {
        DSZ_CHECK(in.numel() == out.numel() * worldSize(), "reduce_scatter", "ds_id ", ds_id,
                  ": input of ", in.numel(), " elements for an output of ", out.numel());
        DSZ_CHECK(out.scalar_type() == in.scalar_type(), "reduce_scatter", "ds_id ", ds_id,
                  ": output dtype ", out.scalar_type(), " differs from the input's ",
                  in.scalar_type());
        run([this, in, out] {
            auto all = world_->exchange(rank_, in.reshape({-1}));
            at::Tensor sum = at::stack(all).sum(0);
            out.view({-1}).copy_(sum.narrow(0, rank_ * out.numel(), out.numel()));
        });
    }

    void allReduceSum(const at::Tensor& buf, int64_t) override
    {
        run([this, buf] {
            auto all = world_->exchange(rank_, buf.reshape({-1}));
            buf.view({-1}).copy_(at::stack(all).sum(0));
        });
    }

    void groupStart() override { ++depth_; }
    void groupEnd() override
    {
        DSZ_CHECK(depth_ > 0, "group_end", "no open group");
        if (--depth_ > 0) { return; }
        auto ops = std::move(deferred_);
        deferred_.clear();
        for (auto& op : ops) { op(); }
    }

private:
    void run(std::function<void()> op)
    {
        if (depth_ > 0) {
            deferred_.push_back(std::move(op));
        } else {
            op();
        }
    }

    std::shared_ptr<LoopbackWorld> world_;
    int64_t rank_;
    int depth_ = 0;
    std::vector<std::function<void()>> deferred_;
};

}  // namespace

std::unique_ptr<Collectives> makeLoopbackCollectives(std::shared_ptr<LoopbackWorld> world,
                                                     int64_t rank)
{
    return std::make_unique<LoopbackCollectives>(std::move(world), rank);
}

}  // namespace dsz
