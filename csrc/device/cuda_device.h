#pragma once

#include <cstdint>
#include <memory>

#include "device/device.h"

namespace dsz {

// Streams on the current CUDA device (CUDA build only).
std::unique_ptr<DeviceBackend> makeCudaDevice();

// What torch.cuda.memory_allocated(device) and torch.cuda.max_memory_allocated(device) answer,
// read in one call from the caching allocator's counters (without the Python stats dict torch
// builds and flattens for each of them). The device must be a visible CUDA device.
struct AllocatedBytes {
    int64_t current = 0;
    int64_t peak = 0;
};
AllocatedBytes cudaAllocatedBytes(int64_t device);

}  // namespace dsz
