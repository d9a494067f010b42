// Chooses the collectives and stream backends for a process group: NCCL + CUDA streams for an
// NCCL group (CUDA build), c10d + host streams for anything else (gloo on CPU).
#pragma once

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <memory>
#include <string>

#include "comm/collectives.h"
#include "device/device.h"

namespace dsz {

struct Backends {
    std::unique_ptr<Collectives> comm;
    std::unique_ptr<DeviceBackend> device;
};

Backends makeBackends(const c10::intrusive_ptr<c10d::ProcessGroup>& pg);
// Throws (naming init) when makeBackends would refuse `pg`, before anything is created.
void checkBackends(const c10::intrusive_ptr<c10d::ProcessGroup>& pg);

// "cpu" or "cuda": what this extension was built with.
const char* buildFlavour();

}  // namespace dsz
