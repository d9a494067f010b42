// Collectives through a private NCCL communicator (CUDA build only). The unique id is broadcast
// through the process group; every NCCL return code is checked and reported with
// ncclGetErrorString, the call and the ds_id.
#pragma once

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <memory>

#include "comm/collectives.h"

namespace dsz {

std::unique_ptr<Collectives> makeNcclCollectives(c10::intrusive_ptr<c10d::ProcessGroup> pg);
int ncclVersionCode();

}  // namespace dsz
