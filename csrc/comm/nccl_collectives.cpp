#include "comm/nccl_collectives.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>
#include <nccl.h>

#include <cstring>
#include <initializer_list>
#include <string>
#include <vector>

#include "core/check.h"

namespace dsz {
namespace {

#define DSZ_NCCL_CHECK(call, op, ds_id)                                                          \
    do {                                                                                         \
        ncclResult_t r_ = (call);                                                                \
        DSZ_CHECK(r_ == ncclSuccess, op, #call " failed for ds_id ", (ds_id), ": ",              \
                  ncclGetErrorString(r_), " (ncclResult_t ", static_cast<int>(r_), ")");         \
    } while (0)

ncclDataType_t ncclTypeOf(at::ScalarType t, const char* op, int64_t ds_id)
{
    switch (t) {
        case at::kFloat: return ncclFloat32;
        case at::kHalf: return ncclFloat16;
        case at::kDouble: return ncclFloat64;
        case at::kBFloat16: return ncclBfloat16;
        case at::kLong: return ncclInt64;
        case at::kInt: return ncclInt32;
        case at::kChar: return ncclInt8;
        case at::kByte: return ncclUint8;
        default: break;
    }
    DSZ_FAIL(op, "dtype ", t, " of ds_id ", ds_id, " is not supported by NCCL");
}

void requireCuda(const at::Tensor& t, const char* op, int64_t ds_id, const char* what)
{
    DSZ_CHECK(t.is_cuda(), op, what, " of ds_id ", ds_id, " must be a CUDA tensor, got ",
              t.device());
    DSZ_CHECK(t.is_contiguous(), op, what, " of ds_id ", ds_id, " must be contiguous");
}

class NcclCollectives final : public Collectives {
public:
    explicit NcclCollectives(c10::intrusive_ptr<c10d::ProcessGroup> pg) : pg_(std::move(pg))
    {
        ncclUniqueId id;
        std::memset(&id, 0, sizeof(id));
        if (pg_->getRank() == 0) { DSZ_NCCL_CHECK(ncclGetUniqueId(&id), "init", -1); }
        // The process group's own backend carries the id: a CUDA tensor for NCCL groups.
        at::Tensor host = at::empty({static_cast<int64_t>(sizeof(id))}, at::kByte);
        std::memcpy(host.data_ptr(), &id, sizeof(id));
        std::vector<at::Tensor> payload{host.to(c10::Device(c10::kCUDA, c10::cuda::current_device()))};
        pg_->broadcast(payload, c10d::BroadcastOptions())->wait();
        at::Tensor back = payload[0].cpu();
        std::memcpy(&id, back.data_ptr(), sizeof(id));
        DSZ_NCCL_CHECK(ncclCommInitRank(&comm_, pg_->getSize(), id, pg_->getRank()), "init", -1);
    }

    ~NcclCollectives() override
    {
        if (comm_ != nullptr) {
            ncclResult_t r = ncclCommDestroy(comm_);
            if (r != ncclSuccess) {
                TORCH_WARN("ds_z3native cleanup: ncclCommDestroy failed: ", ncclGetErrorString(r));
            }
        }
    }

    const char* name() const override { return "nccl"; }
    int64_t rank() const override { return pg_->getRank(); }
    int64_t worldSize() const override { return pg_->getSize(); }

    void allGather(const at::Tensor& shard, const at::Tensor& out, int64_t ds_id) override
    {
        requireCuda(shard, "allgather", ds_id, "shard");
        requireCuda(out, "allgather", ds_id, "output");
        DSZ_CHECK(out.numel() == shard.numel() * worldSize(), "allgather", "ds_id ", ds_id,
                  ": output of ", out.numel(), " elements for a shard of ", shard.numel());
        DSZ_CHECK(out.scalar_type() == shard.scalar_type(), "allgather", "ds_id ", ds_id,
                  ": output dtype ", out.scalar_type(), " differs from shard dtype ",
                  shard.scalar_type());
        DSZ_NCCL_CHECK(ncclAllGather(shard.data_ptr(), out.data_ptr(), shard.numel(),
                                     ncclTypeOf(shard.scalar_type(), "allgather", ds_id), comm_,
                                     c10::cuda::getCurrentCUDAStream()),
                       "allgather", ds_id);
        keepUntilGroupEnd({shard, out});
    }

    void reduceScatterSum(const at::Tensor& in, const at::Tensor& out, int64_t ds_id) override
    {
        requireCuda(in, "reduce_scatter", ds_id, "input");
        requireCuda(out, "reduce_scatter", ds_id, "output");
        DSZ_CHECK(in.numel() == out.numel() * worldSize(), "reduce_scatter", "ds_id ", ds_id,
                  ": input of ", in.numel(), " elements for an output of ", out.numel());
        DSZ_NCCL_CHECK(ncclReduceScatter(in.data_ptr(), out.data_ptr(), out.numel(),
                                         ncclTypeOf(in.scalar_type(), "reduce_scatter", ds_id),
                                         ncclSum, comm_, c10::cuda::getCurrentCUDAStream()),
                       "reduce_scatter", ds_id);
        keepUntilGroupEnd({in, out});
    }

    void allReduceSum(const at::Tensor& buf, int64_t ds_id) override
    {
        requireCuda(buf, "allreduce", ds_id, "buffer");
        DSZ_NCCL_CHECK(ncclAllReduce(buf.data_ptr(), buf.data_ptr(), buf.numel(),
                                     ncclTypeOf(buf.scalar_type(), "allreduce", ds_id), ncclSum,
                                     comm_, c10::cuda::getCurrentCUDAStream()),
                       "allreduce", ds_id);
        keepUntilGroupEnd({buf});
    }

    void groupStart() override
    {
        DSZ_NCCL_CHECK(ncclGroupStart(), "group_start", -1);
        ++depth_;
    }

    void groupEnd() override
    {
        DSZ_CHECK(depth_ > 0, "group_end", "no open group");
        --depth_;
        ncclResult_t r = ncclGroupEnd();
        // The group's collectives are on their stream now: the caching allocator orders any
        // reuse of these buffers (allocated on that stream) after them. After a failure some may
        // still be queued: keep the buffers (a leak) rather than hand them out again.
        if (depth_ == 0 && r == ncclSuccess) { pending_.clear(); }
        DSZ_CHECK(r == ncclSuccess, "group_end", "ncclGroupEnd() failed: ", ncclGetErrorString(r),
                  " (ncclResult_t ", static_cast<int>(r), ")");
    }

private:
    // Inside a group NCCL only records a collective; it reads the buffers at ncclGroupEnd. A
    // temporary (a shard converted to the gather dtype) must not go back to the allocator and be
    // handed to the next collective of the same group before then.
    void keepUntilGroupEnd(std::initializer_list<at::Tensor> tensors)
    {
        if (depth_ == 0) { return; }
        pending_.insert(pending_.end(), tensors.begin(), tensors.end());
    }

    int depth_ = 0;
    std::vector<at::Tensor> pending_;
    c10::intrusive_ptr<c10d::ProcessGroup> pg_;
    ncclComm_t comm_ = nullptr;
};

}  // namespace

std::unique_ptr<Collectives> makeNcclCollectives(c10::intrusive_ptr<c10d::ProcessGroup> pg)
{
    DSZ_CHECK(pg, "init", "process_group is None");
    return std::make_unique<NcclCollectives>(std::move(pg));
}

int ncclVersionCode() { return NCCL_VERSION_CODE; }

}  // namespace dsz
