// Activation offload for one graph: copies to host buffers on the offload stream and back on the
// reload stream, keyed by the value id the compiler assigned.
#pragma once

#include <ATen/core/Tensor.h>

#include <memory>
#include <unordered_map>

#include "device/device.h"

namespace dsz {

class ActivationOffload {
public:
    ActivationOffload(DeviceBackend& device, bool pin_memory) : device_(device), pin_(pin_memory) {}

    at::Tensor offload(const at::Tensor& t, int64_t id, const char* op);
    at::Tensor reload(int64_t id, const char* op);
    at::Tensor waitOffload(int64_t id, const char* op);
    // `fallback` is returned while profiling when nothing was reloaded.
    at::Tensor waitReload(int64_t id, const at::Tensor& fallback, bool profiling, const char* op);
    // End of backward: reloaded tensors may be freed once the compute stream is done with them.
    void releaseReloaded();

private:
    struct Slot {
        at::Tensor host;
        at::Tensor reloaded;
        std::shared_ptr<Event> offloaded;
        std::shared_ptr<Event> reloaded_done;
    };
    Slot& slot(int64_t id, const char* op);

    DeviceBackend& device_;
    bool pin_;
    std::unordered_map<int64_t, Slot> slots_;
    std::shared_ptr<Event> compute_ready_;
};

}  // namespace dsz
