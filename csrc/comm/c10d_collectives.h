// Collectives over a c10d ProcessGroup (any backend; gloo on CPU). Outside a group each call
// waits for its work; inside a group the works run concurrently and groupEnd() waits for all.
#pragma once

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <memory>

#include "comm/collectives.h"

namespace dsz {

std::unique_ptr<Collectives> makeC10dCollectives(c10::intrusive_ptr<c10d::ProcessGroup> pg);

}  // namespace dsz
