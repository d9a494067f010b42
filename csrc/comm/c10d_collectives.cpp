#include "comm/c10d_collectives.h"

#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/core/impl/PythonDispatcherTLS.h>

#include <string>
#include <utility>
#include <vector>

#include "core/check.h"
#include "python_gil.h"

// _allgather_base/_reduce_scatter_base are deprecated aliases in torch >= 2.13 but the only
// names shared with the older releases we build against.
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"

namespace dsz {
namespace {

// Waits on c10d work without the GIL (see python_gil.h).
void waitWithoutGil(const c10::intrusive_ptr<c10d::Work>& work)
{
    GilReleasedIfHeld no_gil;
    work->wait();
}

// Issues a collective with Python out of its way. Under torch.compile's Python dispatcher or a
// dispatch mode the c10d op would be dispatched through Python, so gloo's queue lock would be
// taken holding the GIL, and the worker inherits the dispatcher and needs the GIL to run the
// work; meanwhile gloo's worker holds that queue lock while it drops a finished work, whose
// Python-owned tensor needs the GIL: a deadlock. Our tensors are real, so neither the dispatcher
// nor the modes change what the collective does.
template <typename Issue>
c10::intrusive_ptr<c10d::Work> issueOutsidePython(Issue&& issue)
{
    c10::impl::DisablePythonDispatcher no_python_dispatcher;
    c10::impl::ExcludeDispatchKeyGuard no_modes(
        c10::DispatchKeySet({c10::DispatchKey::Python, c10::DispatchKey::PythonTLSSnapshot}));
    GilReleasedIfHeld no_gil;
    return issue();
}

class C10dCollectives final : public Collectives {
public:
    explicit C10dCollectives(c10::intrusive_ptr<c10d::ProcessGroup> pg)
        : pg_(std::move(pg)), name_("c10d:" + pg_->getBackendName())
    {
    }

    const char* name() const override { return name_.c_str(); }
    int64_t rank() const override { return pg_->getRank(); }
    int64_t worldSize() const override { return pg_->getSize(); }

    void allGather(const at::Tensor& shard, const at::Tensor& out, int64_t ds_id) override
    {
        DSZ_CHECK(out.numel() == shard.numel() * worldSize(), "allgather", "ds_id ", ds_id,
                  ": output of ", out.numel(), " elements for a shard of ", shard.numel(),
                  " at world size ", worldSize());
        at::Tensor in = shard.contiguous();
        at::Tensor o = out;
        submit(issueOutsidePython([&] { return pg_->_allgather_base(o, in); }), "allgather", ds_id,
               {in, o});
    }

    void reduceScatterSum(const at::Tensor& in, const at::Tensor& out, int64_t ds_id) override
    {
        DSZ_CHECK(in.numel() == out.numel() * worldSize(), "reduce_scatter", "ds_id ", ds_id,
                  ": input of ", in.numel(), " elements for an output of ", out.numel(),
                  " at world size ", worldSize());
        at::Tensor i = in.contiguous();
        at::Tensor o = out;
        c10d::ReduceScatterOptions opts;
        opts.reduceOp = c10d::ReduceOp::SUM;
        submit(issueOutsidePython([&] { return pg_->_reduce_scatter_base(o, i, opts); }),
               "reduce_scatter", ds_id, {i, o});
    }

    void allReduceSum(const at::Tensor& buf, int64_t ds_id) override
    {
        std::vector<at::Tensor> v{buf};
        c10d::AllreduceOptions opts;
        opts.reduceOp = c10d::ReduceOp::SUM;
        submit(issueOutsidePython([&] { return pg_->allreduce(v, opts); }), "allreduce", ds_id, {buf});
    }

    void groupStart() override { ++depth_; }

    void groupEnd() override
    {
        DSZ_CHECK(depth_ > 0, "group_end", "no open group");
        if (--depth_ > 0) { return; }
        std::vector<Pending> pending;
        pending.swap(pending_);
        std::string first_error;
        for (Pending& p : pending) {
            try {
                waitWithoutGil(p.work);
            } catch (const std::exception& e) {
                // Keep waiting on the rest so no work outlives its tensors; report the first.
                if (first_error.empty()) { first_error = describe(p.op, p.ds_id, e.what()); }
            }
        }
        DSZ_CHECK(first_error.empty(), "group_end", first_error);
    }

private:
    struct Pending {
        c10::intrusive_ptr<c10d::Work> work;
        const char* op;
        int64_t ds_id;
        std::vector<at::Tensor> keep;  // tensors the work reads or writes
    };

    std::string describe(const char* op, int64_t ds_id, const char* what) const
    {
        return std::string(op) + " on " + name_ + " failed for ds_id " + std::to_string(ds_id) +
               ": " + what;
    }

    void submit(c10::intrusive_ptr<c10d::Work> work, const char* op, int64_t ds_id,
                std::vector<at::Tensor> keep)
    {
        if (depth_ > 0) {
            pending_.push_back(Pending{std::move(work), op, ds_id, std::move(keep)});
            return;
        }
        try {
            waitWithoutGil(work);
        } catch (const std::exception& e) {
            DSZ_FAIL(op, describe(op, ds_id, e.what()));
        }
    }

    c10::intrusive_ptr<c10d::ProcessGroup> pg_;
    std::string name_;
    int depth_ = 0;
    std::vector<Pending> pending_;
};

}  // namespace

std::unique_ptr<Collectives> makeC10dCollectives(c10::intrusive_ptr<c10d::ProcessGroup> pg)
{
    DSZ_CHECK(pg, "init", "process_group is None");
    return std::make_unique<C10dCollectives>(std::move(pg));
}

}  // namespace dsz
