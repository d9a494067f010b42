// CUDA streams and events for the runtime's stream roles. Compute is the stream current when an
// op is entered; the other roles are high-priority pool streams owned by this object.
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAFunctions.h>

#include <array>
#include <optional>

#include "device/cuda_device.h"

namespace dsz {
namespace {

class CudaDevice;

// A CUDA event created on first record; blocking on a never-recorded event waits for nothing.
class CudaEvent final : public Event {
public:
    explicit CudaEvent(CudaDevice& dev) : dev_(dev) {}
    ~CudaEvent() override
    {
        if (event_ != nullptr) { cudaEventDestroy(event_); }
    }
    CudaEvent(const CudaEvent&) = delete;
    CudaEvent& operator=(const CudaEvent&) = delete;
    void record(StreamRole role) override;
    void block(StreamRole role) override;

private:
    CudaDevice& dev_;
    cudaEvent_t event_ = nullptr;
};

class CudaScope final : public StreamScope {
public:
    explicit CudaScope(c10::cuda::CUDAStream s) : guard_(s) {}

private:
    c10::cuda::CUDAStreamGuard guard_;
};

class CudaDevice final : public DeviceBackend {
public:
    CudaDevice() : device_(c10::kCUDA, c10::cuda::current_device())
    {
        for (size_t i = 1; i < streams_.size(); ++i) {
            streams_[i].emplace(c10::cuda::getStreamFromPool(/*isHighPriority=*/true, device_.index()));
        }
    }

    c10::cuda::CUDAStream stream(StreamRole role) const
    {
        if (role == StreamRole::Compute) { return c10::cuda::getCurrentCUDAStream(device_.index()); }
        return *streams_[static_cast<size_t>(role)];
    }

    const char* name() const override { return "cuda"; }
    c10::Device computeDevice() const override { return device_; }
    std::shared_ptr<Event> newEvent() override { return std::make_shared<CudaEvent>(*this); }
    std::unique_ptr<StreamScope> use(StreamRole role) override
    {
        return std::make_unique<CudaScope>(stream(role));
    }
    void synchronizeDevice() override { c10::cuda::device_synchronize(); }
    void recordStream(const at::Tensor& t, StreamRole role) override
    {
        if (!t.defined() || !t.is_cuda() || t.storage().nbytes() == 0) { return; }
        c10::cuda::CUDACachingAllocator::recordStream(t.storage().data_ptr(), stream(role));
    }
    bool supportsPinnedMemory() const override { return true; }

private:
    c10::Device device_;
    std::array<std::optional<c10::cuda::CUDAStream>, 6> streams_;
};

void CudaEvent::record(StreamRole role)
{
    c10::cuda::CUDAStream s = dev_.stream(role);
    c10::cuda::CUDAGuard guard(s.device_index());
    if (event_ == nullptr) { C10_CUDA_CHECK(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming)); }
    C10_CUDA_CHECK(cudaEventRecord(event_, s.stream()));
}

void CudaEvent::block(StreamRole role)
{
    if (event_ == nullptr) { return; }
    c10::cuda::CUDAStream s = dev_.stream(role);
    c10::cuda::CUDAGuard guard(s.device_index());
    C10_CUDA_CHECK(cudaStreamWaitEvent(s.stream(), event_, 0));
}

}  // namespace

std::unique_ptr<DeviceBackend> makeCudaDevice() { return std::make_unique<CudaDevice>(); }

AllocatedBytes cudaAllocatedBytes(int64_t device)
{
    const int64_t visible = c10::cuda::device_count();
    TORCH_CHECK(device >= 0 && device < visible, "cuda_allocated_bytes: device ", device,
                " is not a visible CUDA device (", visible, " visible)");
    const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(static_cast<c10::DeviceIndex>(device));
    // Index 0 of each stat array is the aggregate over both pools, the "all" of
    // torch.cuda.memory_stats().
    const auto& allocated = stats.allocated_bytes[0];
    return AllocatedBytes{allocated.current, allocated.peak};
}

}  // namespace dsz
