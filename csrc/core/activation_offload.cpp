#include "core/activation_offload.h"

#include <ATen/ops/empty_like.h>

#include "core/check.h"

namespace dsz {

ActivationOffload::Slot& ActivationOffload::slot(int64_t id, const char* op)
{
    auto it = slots_.find(id);
    DSZ_CHECK(it != slots_.end(), op, "unknown activation id ", id,
              " (offload_tensor was not called for it)");
    return it->second;
}

at::Tensor ActivationOffload::offload(const at::Tensor& t, int64_t id, const char* op)
{
    DSZ_CHECK(t.defined(), op, "undefined tensor for activation id ", id);
    DSZ_CHECK(hasData(t), op, "the tensor of activation id ", id, " (shape ", t.sizes(),
              ") has no data (its storage was freed, e.g. by release_param)");
    Slot& s = slots_[id];
    if (!s.host.defined() || !s.host.sizes().equals(t.sizes()) || s.host.dtype() != t.dtype()) {
        const bool pin = pin_ && device_.supportsPinnedMemory();
        s.host = at::empty_like(t, t.options().device(c10::kCPU).pinned_memory(pin),
                                c10::MemoryFormat::Contiguous);
        s.offloaded = device_.newEvent();
    }
    if (!compute_ready_) { compute_ready_ = device_.newEvent(); }
    compute_ready_->record(StreamRole::Compute);
    compute_ready_->block(StreamRole::Offload);
    {
        auto scope = device_.use(StreamRole::Offload);
        s.host.copy_(t, /*non_blocking=*/true);
    }
    device_.recordStream(t, StreamRole::Offload);
    s.offloaded->record(StreamRole::Offload);
    return s.host;
}

at::Tensor ActivationOffload::reload(int64_t id, const char* op)
{
    Slot& s = slot(id, op);
    s.offloaded->block(StreamRole::Reload);
    {
        auto scope = device_.use(StreamRole::Reload);
        s.reloaded = at::empty_like(s.host, s.host.options().device(device_.computeDevice()).pinned_memory(false));
        s.reloaded.copy_(s.host, /*non_blocking=*/true);
    }
    if (!s.reloaded_done) { s.reloaded_done = device_.newEvent(); }
    s.reloaded_done->record(StreamRole::Reload);
    return s.reloaded;
}

at::Tensor ActivationOffload::waitOffload(int64_t id, const char* op)
{
    Slot& s = slot(id, op);
    s.offloaded->block(StreamRole::Compute);
    return s.host;
}

at::Tensor ActivationOffload::waitReload(int64_t id, const at::Tensor& fallback, bool profiling,
                                         const char* op)
{
    auto it = slots_.find(id);
    if (profiling && (it == slots_.end() || !it->second.reloaded.defined())) { return fallback; }
    Slot& s = slot(id, op);
    DSZ_CHECK(s.reloaded.defined(), op, "activation id ", id, " was not reloaded (reload_tensor)");
    s.reloaded_done->block(StreamRole::Compute);
    return s.reloaded;
}

void ActivationOffload::releaseReloaded()
{
    for (auto& [id, s] : slots_) {
        if (s.reloaded.defined()) {
            device_.recordStream(s.reloaded, StreamRole::Compute);
            s.reloaded = at::Tensor();
        }
    }
}

}  // namespace dsz
