#include "comm/c10d_collectives.h"

#include <ATen/PythonTorchFunctionTLS.h>
#include <ATen/SavedTensorHooks.h>
#include <ATen/ThreadLocalPythonObjects.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/core/impl/PythonDispatcherTLS.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>

#include <chrono>
#include <string>
#include <thread>
#include <typeinfo>
#include <utility>
#include <vector>

#include "core/check.h"
#include "python_gil.h"

// _allgather_base/_reduce_scatter_base are deprecated aliases in torch >= 2.13 but the only
// names shared with the older releases we build against.
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"

namespace dsz {
namespace {

// Waits on c10d work without the GIL (see python_gil.h). With gloo it also waits, briefly, for
// gloo's worker to drop its own reference to the work (right after completing it), so that the
// work and all it holds are destroyed on this thread, where taking the GIL to drop a Python
// object is safe (see pythonFreeHandle for why gloo's worker must not).
void waitWithoutGil(const c10::intrusive_ptr<c10d::Work>& work, bool await_sole_owner)
{
    GilReleasedIfHeld no_gil;
    work->wait();
    if (!await_sole_owner) { return; }
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(200);
    while (work.use_count() > 1 && std::chrono::steady_clock::now() < deadline) {
        std::this_thread::yield();
    }
}

// Empties, for its lifetime, the thread-local state that holds Python objects: dispatch modes,
// torch-function modes, saved-tensor hooks (non-reentrant checkpointing's among them) and stashed
// objects. c10d's gloo backend copies the caller's thread-local state into each work and its
// worker runs the work under it, so whatever Python objects it holds are copied (the GIL taken)
// and dropped (the GIL taken) on gloo's worker thread; one dropped while the interpreter shuts
// down aborts the process ("terminate called without an active exception").
class PythonStateCleared {
public:
    PythonStateCleared()
        : keys_(c10::impl::tls_local_dispatch_key_set()),
          modes_(c10::impl::TorchDispatchModeTLS::get_state()),
          function_modes_(at::impl::PythonTorchFunctionTLS::get_state()),
          hooks_(at::SavedTensorDefaultHooks::get_tls_state()),
          objects_(at::impl::ThreadLocalPythonObjects::get_state())
    {
        c10::impl::TorchDispatchModeTLS::set_state(c10::impl::TorchDispatchModeTLS());
        at::impl::PythonTorchFunctionTLS::set_state(at::impl::PythonTorchFunctionTLS());
        at::SavedTensorDefaultHooks::set_tls_state(at::impl::SavedTensorDefaultHooksTLS());
        at::impl::ThreadLocalPythonObjects::set_state(at::impl::ThreadLocalPythonObjects());
    }
    ~PythonStateCleared()
    {
        c10::impl::TorchDispatchModeTLS::set_state(std::move(modes_));
        at::impl::PythonTorchFunctionTLS::set_state(function_modes_);
        at::SavedTensorDefaultHooks::set_tls_state(hooks_);
        at::impl::ThreadLocalPythonObjects::set_state(std::move(objects_));
        // set_state above recomputes the Python keys from the mode stack: put back the exact set.
        c10::impl::_force_tls_local_dispatch_key_set(keys_);
    }
    PythonStateCleared(const PythonStateCleared&) = delete;
    PythonStateCleared& operator=(const PythonStateCleared&) = delete;

private:
    c10::impl::LocalDispatchKeySet keys_;
    c10::impl::TorchDispatchModeTLS modes_;
    at::impl::PythonTorchFunctionTLS function_modes_;
    at::impl::SavedTensorDefaultHooksTLS hooks_;
    at::impl::ThreadLocalPythonObjects objects_;
};

// A new handle on t's storage, made without the dispatcher, that Python has never seen. gloo's
// worker drops its references to a work's tensors after our wait has returned; dropping a C++
// reference to a tensor that has a Python object can take the GIL (torch >= 2.13 keeps that
// object alive while C++ also holds the tensor), so a tensor made under a dispatch mode, or
// returned to Python before, would again need the GIL on gloo's worker, at interpreter shutdown
// an abort. Only plain dense tensors (all the runtime hands to collectives) are re-wrapped.
at::Tensor pythonFreeHandle(const at::Tensor& t)
{
    if (typeid(*t.unsafeGetTensorImpl()) != typeid(c10::TensorImpl)) { return t; }
    const c10::DispatchKeySet keys = t.key_set()
                                         .remove(c10::DispatchKey::Python)
                                         .remove(c10::DispatchKey::PythonTLSSnapshot);
    at::Tensor handle =
        at::detail::make_tensor<c10::TensorImpl>(c10::Storage(t.storage()), keys, t.dtype());
    handle.unsafeGetTensorImpl()->set_sizes_and_strides(t.sizes(), t.strides(),
                                                         t.storage_offset());
    return handle;
}

// Issues a collective with Python out of its way. Under torch.compile's Python dispatcher or a
// dispatch mode the c10d op would be dispatched through Python, so gloo's queue lock would be
// taken holding the GIL, and the worker inherits the dispatcher and needs the GIL to run the
// work; meanwhile gloo's worker holds that queue lock while it drops a finished work, whose
// Python-owned tensor needs the GIL: a deadlock. Our tensors are real, so neither the dispatcher
// nor the modes change what the collective does. The Python objects of the thread-local state
// are kept out of the work too (PythonStateCleared). The state is saved and restored holding
// the GIL (if the caller held it): copies of Python objects take it.
template <typename Issue>
c10::intrusive_ptr<c10d::Work> issueOutsidePython(Issue&& issue)
{
    c10::impl::DisablePythonDispatcher no_python_dispatcher;
    c10::impl::ExcludeDispatchKeyGuard no_modes(
        c10::DispatchKeySet({c10::DispatchKey::Python, c10::DispatchKey::PythonTLSSnapshot}));
    PythonStateCleared no_python_state;
    GilReleasedIfHeld no_gil;
    return issue();
}

class C10dCollectives final : public Collectives {
public:
    explicit C10dCollectives(c10::intrusive_ptr<c10d::ProcessGroup> pg)
        : pg_(std::move(pg)), name_("c10d:" + pg_->getBackendName()),
          gloo_(pg_->getBackendName() == "gloo")
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
        at::Tensor in = pythonFreeHandle(shard.contiguous());
        at::Tensor o = pythonFreeHandle(out);
        submit(issueOutsidePython([&] { return pg_->_allgather_base(o, in); }), "allgather", ds_id,
               {in, o});
    }

    void reduceScatterSum(const at::Tensor& in, const at::Tensor& out, int64_t ds_id) override
    {
        DSZ_CHECK(in.numel() == out.numel() * worldSize(), "reduce_scatter", "ds_id ", ds_id,
                  ": input of ", in.numel(), " elements for an output of ", out.numel(),
                  " at world size ", worldSize());
        at::Tensor i = pythonFreeHandle(in.contiguous());
        at::Tensor o = pythonFreeHandle(out);
        c10d::ReduceScatterOptions opts;
        opts.reduceOp = c10d::ReduceOp::SUM;
        submit(issueOutsidePython([&] { return pg_->_reduce_scatter_base(o, i, opts); }),
               "reduce_scatter", ds_id, {i, o});
    }

    void allReduceSum(const at::Tensor& buf, int64_t ds_id) override
    {
        std::vector<at::Tensor> v{pythonFreeHandle(buf)};
        c10d::AllreduceOptions opts;
        opts.reduceOp = c10d::ReduceOp::SUM;
        submit(issueOutsidePython([&] { return pg_->allreduce(v, opts); }), "allreduce", ds_id,
               {v[0]});
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
                waitWithoutGil(p.work, gloo_);
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
            waitWithoutGil(work, gloo_);
        } catch (const std::exception& e) {
            DSZ_FAIL(op, describe(op, ds_id, e.what()));
        }
    }

    c10::intrusive_ptr<c10d::ProcessGroup> pg_;
    std::string name_;
    bool gloo_;  // waits also for gloo's worker to drop its reference to each work
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
