#include "backends.h"

#include <cstdlib>

#include "comm/c10d_collectives.h"
#include "core/check.h"
#ifdef DSZ_WITH_CUDA
#include "comm/nccl_collectives.h"
#include "device/cuda_device.h"
#endif

namespace dsz {

const char* buildFlavour()
{
#ifdef DSZ_WITH_CUDA
    return "cuda";
#else
    return "cpu";
#endif
}

namespace {
bool isNccl(const c10d::ProcessGroup& pg)
{
    return pg.getBackendName().find("nccl") != std::string::npos;
}
}  // namespace

void checkBackends(const c10::intrusive_ptr<c10d::ProcessGroup>& pg)
{
    DSZ_CHECK(pg, "init", "process_group is None");
#ifndef DSZ_WITH_CUDA
    DSZ_CHECK(!isNccl(*pg), "init", "the process group uses '", pg->getBackendName(),
              "' but this ds_z3native build has no CUDA (build flavour 'cpu'); reinstall "
              "with CUDA available (pip install --no-build-isolation -e . with CUDA_HOME set) "
              "or use a gloo process group");
#endif
}

Backends makeBackends(const c10::intrusive_ptr<c10d::ProcessGroup>& pg)
{
    checkBackends(pg);
    Backends b;
    if (isNccl(*pg)) {
#ifdef DSZ_WITH_CUDA
        b.device = makeCudaDevice();
        b.comm = makeNcclCollectives(pg);
#endif
    } else {
        b.device = makeHostDevice();
        b.comm = makeC10dCollectives(pg);
    }
    return b;
}

}  // namespace dsz
