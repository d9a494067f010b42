#include "device/device.h"

namespace dsz {

const char* streamRoleName(StreamRole role)
{
    switch (role) {
        case StreamRole::Compute: return "compute";
        case StreamRole::AllGather: return "allgather";
        case StreamRole::ReduceScatter: return "reduce_scatter";
        case StreamRole::Copy: return "copy";
        case StreamRole::Offload: return "offload";
        case StreamRole::Reload: return "reload";
    }
    return "unknown";
}

namespace {

class HostEvent final : public Event {
public:
    void record(StreamRole) override {}
    void block(StreamRole) override {}
};

class HostScope final : public StreamScope {};

class HostDevice final : public DeviceBackend {
public:
    const char* name() const override { return "host"; }
    c10::Device computeDevice() const override { return c10::Device(c10::kCPU); }
    std::shared_ptr<Event> newEvent() override { return std::make_shared<HostEvent>(); }
    std::unique_ptr<StreamScope> use(StreamRole) override { return std::make_unique<HostScope>(); }
    void synchronizeDevice() override {}
    void recordStream(const at::Tensor&, StreamRole) override {}
    bool supportsPinnedMemory() const override { return false; }
};

}  // namespace

std::unique_ptr<DeviceBackend> makeHostDevice() { return std::make_unique<HostDevice>(); }

}  // namespace dsz
