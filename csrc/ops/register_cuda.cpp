#include "ops/register_device.h"

TORCH_LIBRARY_IMPL(dc, CUDA, m) { dsz::ops::registerDeviceKernels(m); }
