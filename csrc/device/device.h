// Streams and events behind a small interface. The CUDA implementation maps each role to a CUDA
// stream; the host implementation runs everything in order on the calling thread, so its events
// and stream switches are no-ops.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <memory>

namespace dsz {

// The roles the runtime schedules work on. Compute is whatever stream was current when the op
// was entered (the stream the compiled graph runs on).
enum class StreamRole { Compute, AllGather, ReduceScatter, Copy, Offload, Reload };

const char* streamRoleName(StreamRole role);

class Event {
public:
    virtual ~Event() = default;
    // Marks the point reached so far by `role`.
    virtual void record(StreamRole role) = 0;
    // Makes later work on `role` wait until the recorded point is reached.
    virtual void block(StreamRole role) = 0;
};

// While alive, `role` is the current stream of the calling thread.
class StreamScope {
public:
    virtual ~StreamScope() = default;
};

class DeviceBackend {
public:
    virtual ~DeviceBackend() = default;
    virtual const char* name() const = 0;
    // The device the gathered parameters and reduce buckets live on.
    virtual c10::Device computeDevice() const = 0;
    virtual std::shared_ptr<Event> newEvent() = 0;
    virtual std::unique_ptr<StreamScope> use(StreamRole role) = 0;
    virtual void synchronizeDevice() = 0;
    // Tells the allocator that `t` is in use on `role` (so its memory is not reused too early).
    virtual void recordStream(const at::Tensor& t, StreamRole role) = 0;
    // Options for host staging buffers of activation offload.
    virtual bool supportsPinnedMemory() const = 0;
};

// In-order backend for CPU tensors (and for tests).
std::unique_ptr<DeviceBackend> makeHostDevice();

}  // namespace dsz
