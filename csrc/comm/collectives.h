// The collectives the runtime needs, behind one interface with three implementations:
// NCCL (CUDA build), c10d ProcessGroup (any backend; gloo on CPU) and an in-process loopback that
// simulates N ranks for the native unit tests.
//
// Every call is issued on the device backend's current stream (the runtime enters the
// AllGather or ReduceScatter role first). Between groupStart() and groupEnd() calls may be
// deferred: their outputs are valid only after groupEnd(). `ds_id` only labels error messages.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>

namespace dsz {

class Collectives {
public:
    virtual ~Collectives() = default;
    virtual const char* name() const = 0;
    virtual int64_t rank() const = 0;
    virtual int64_t worldSize() const = 0;

    // out (contiguous, world_size * shard.numel() elements) <- every rank's shard, rank-major.
    virtual void allGather(const at::Tensor& shard, const at::Tensor& out, int64_t ds_id) = 0;
    // out (contiguous, in.numel() / world_size elements) <- this rank's chunk of the sum over ranks.
    virtual void reduceScatterSum(const at::Tensor& in, const at::Tensor& out, int64_t ds_id) = 0;
    // buf <- sum over ranks, in place.
    virtual void allReduceSum(const at::Tensor& buf, int64_t ds_id) = 0;

    virtual void groupStart() = 0;
    virtual void groupEnd() = 0;
};

// Opens a group for its lifetime. end() reports errors; the destructor closes a group left open
// by an exception without throwing again.
class CommGroup {
public:
    explicit CommGroup(Collectives& comm) : comm_(comm) { comm_.groupStart(); }
    CommGroup(const CommGroup&) = delete;
    CommGroup& operator=(const CommGroup&) = delete;
    void end()
    {
        open_ = false;
        comm_.groupEnd();
    }
    ~CommGroup()
    {
        if (open_) {
            try {
                comm_.groupEnd();
            } catch (...) {
                // An exception is already propagating; it is the one the caller needs to see.
            }
        }
    }

private:
    Collectives& comm_;
    bool open_ = true;
};

}  // namespace dsz
