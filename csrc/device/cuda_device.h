#pragma once

#include <memory>

#include "device/device.h"

namespace dsz {

// Streams on the current CUDA device (CUDA build only).
std::unique_ptr<DeviceBackend> makeCudaDevice();

}  // namespace dsz
