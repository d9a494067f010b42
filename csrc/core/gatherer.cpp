#include "core/gatherer.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>

#include <cstdint>

#include "core/check.h"

namespace dsz {

Gatherer::Gatherer(Collectives& comm, DeviceBackend& device, CommStats& stats)
    : comm_(comm), device_(device), stats_(stats), compute_ready_(device.newEvent())
{
}

// The param's shape over the front of its gathered buffer. Called on every allgather_param, so
// it makes one view, not two, when the buffer holds no padding (always on one rank).
static at::Tensor fullView(const ParamEntry& p, const at::Tensor& flat)
{
    if (flat.numel() == p.numel) { return flat.view(p.shape); }
    return flat.narrow(0, 0, p.numel).view(p.shape);
}

at::Tensor Gatherer::metaOf(const ParamEntry& p, std::optional<at::ScalarType> dtype)
{
    return at::empty(p.shape, at::TensorOptions()
                                  .dtype(dtype.value_or(p.shard.scalar_type()))
                                  .device(c10::kMeta));
}

// The shard (or its reloaded copy) must be readable before anything is gathered from it.
static void requireShardData(const ParamEntry& p, const char* op)
{
    DSZ_CHECK(hasData(p.reloaded.defined() ? p.reloaded : p.shard), op, "the shard of ds_id ",
              p.ds_id, " has no data (its storage was freed after registration)");
}

at::Tensor Gatherer::shardForGather(ParamEntry& p, at::ScalarType dtype)
{
    // Partitions never take part in autograd here (a shard registered with requires_grad=True
    // would make the gathered buffer an autograd view). Each skipped detach/view is one
    // dispatcher call less per gather.
    at::Tensor shard = p.shard.requires_grad() ? p.shard.detach() : p.shard;
    if (p.reloaded.defined()) {
        if (p.reload_done) { p.reload_done->block(StreamRole::AllGather); }
        shard = p.reloaded;
    } else if (p.offload_done) {
        p.offload_done->block(StreamRole::AllGather);
    }
    const c10::Device dev = device_.computeDevice();
    if (shard.device() != dev || shard.scalar_type() != dtype || !shard.is_contiguous()) {
        shard = shard.to(dev, dtype, /*non_blocking=*/false, /*copy=*/false,
                         c10::MemoryFormat::Contiguous);
    }
    return shard.dim() == 1 ? shard : shard.view(-1);
}

bool isGatherAligned(const at::Tensor& t)
{
    return reinterpret_cast<std::uintptr_t>(t.const_data_ptr()) % kGatherAlignment == 0;
}

bool Gatherer::aliasesShard(const ParamEntry& p, at::ScalarType dtype) const
{
    if (comm_.worldSize() != 1 || p.reloaded.defined()) { return false; }
    const at::Tensor& s = p.shard;
    // ZeRO-3 keeps its partitions as views into one flat buffer: a shard that starts off the
    // alignment inductor assumes for an op's output is copied instead.
    return s.scalar_type() == dtype && s.numel() == p.layout.padded && s.is_contiguous() &&
           s.device() == device_.computeDevice() && isGatherAligned(s);
}

// The shard's memory under a storage of its own. Every other param's shard lies in the same flat
// buffer, so views of it would share one storage, and the outputs of one gather_persistent call
// would alias each other for torch (its custom-op contract refuses that). Their memory does not
// overlap; the flat buffer stays alive while the tensor does.
static at::Tensor ownStorageOf(const at::Tensor& flat)
{
    c10::Storage keep_alive = flat.storage();
    return at::from_blob(
        flat.data_ptr(), flat.sizes(), flat.strides(),
        [keep_alive](void*) mutable { keep_alive = c10::Storage(); }, flat.options(),
        flat.device());
}

void Gatherer::useShard(ParamEntry& p)
{
    if (p.gathered.defined() && !p.gathered_is_shard && p.gathered.storage().nbytes() > 0) {
        // A stale copy in another dtype goes; kernels queued on the compute stream may still
        // read it.
        device_.recordStream(p.gathered, StreamRole::Compute);
    }
    at::Tensor flat = p.shard.requires_grad() ? p.shard.detach() : p.shard;
    p.gathered = ownStorageOf(flat.dim() == 1 ? flat : flat.view(-1));
    p.gathered_is_shard = true;
    p.has_gathered = true;
    p.valid = true;
    // Counted as the gather it stands for, as the reducer counts its reduce-scatters on one
    // rank: comm_stats() reads the same at every world size.
    stats_.allgather_calls += 1;
    stats_.allgather_bytes += p.paddedShardBytes();
}

at::Tensor Gatherer::prepareBuffer(ParamEntry& p, at::ScalarType dtype)
{
    const at::Tensor& old = p.gathered;
    if (old.defined() && !p.gathered_is_shard && old.numel() == p.layout.padded &&
        old.scalar_type() == dtype && old.storage().nbytes() > 0) {
        return old;
    }
    return at::empty({p.layout.padded},
                     at::TensorOptions().dtype(dtype).device(device_.computeDevice()));
}

// The dtypes every collectives backend gathers (NCCL's list; gloo takes them all). Checked
// before anything is marked gathered.
static void requireGatherDtype(const ParamEntry& p, at::ScalarType dtype, const char* op,
                               const Collectives& comm)
{
    const bool ok = dtype == at::kFloat || dtype == at::kHalf || dtype == at::kDouble ||
                    dtype == at::kBFloat16 || dtype == at::kLong || dtype == at::kInt ||
                    dtype == at::kChar || dtype == at::kByte;
    DSZ_CHECK(ok, op, "ds_id ", p.ds_id, " cannot be gathered in ", dtype, " by ", comm.name(),
              " (dtypes supported by NCCL, and so by every backend: Float, Half, Double, "
              "BFloat16, Long, Int, Char, Byte)");
}

void Gatherer::gatherInto(ParamEntry& p, const at::Tensor& buffer)
{
    at::Tensor shard = shardForGather(p, buffer.scalar_type());
    comm_.allGather(shard, buffer, p.ds_id);
    stats_.allgather_calls += 1;
    stats_.allgather_bytes += buffer.numel() * static_cast<int64_t>(buffer.element_size());
}

void Gatherer::launch(ParamEntry& p, const at::Tensor& buffer)
{
    gatherInto(p, buffer);
    p.gathered = buffer;
    p.gathered_is_shard = false;
    p.has_gathered = true;
    p.valid = true;
}

at::Tensor Gatherer::gather(ParamEntry& p, std::optional<at::ScalarType> dtype, const char* op)
{
    DSZ_CHECK(p.partitioned, op, "ds_id ", p.ds_id,
              " was registered with register_param (ZeRO-1/2) and is not partitioned");
    const at::ScalarType target = dtype.value_or(p.shard.scalar_type());
    requireGatherDtype(p, target, op, comm_);
    const bool have_copy = p.valid && p.gathered.defined();
    if (!have_copy) { requireShardData(p, op); }
    if (have_copy) {
        // A persistent copy is kept in the dtype it was first gathered in. Converting reads it
        // on the compute stream, so a gather still in flight must finish first.
        at::Tensor full = fullView(p, p.gathered);
        if (full.scalar_type() == target) { return full; }
        if (p.gathered.scalar_type() == p.shard.scalar_type()) {
            wait(p);
            return full.to(target);  // the shard's own values: converting them is exact
        }
        // A copy in a third dtype carries its rounding (bf16, or an int's truncation): gather
        // this request afresh from the shard, without replacing the kept copy.
        requireShardData(p, op);
        compute_ready_->record(StreamRole::Compute);
        compute_ready_->block(StreamRole::AllGather);
        at::Tensor buffer;
        {
            auto scope = device_.use(StreamRole::AllGather);
            buffer = at::empty({p.layout.padded},
                               at::TensorOptions().dtype(target).device(device_.computeDevice()));
            gatherInto(p, buffer);
        }
        device_.recordStream(buffer, StreamRole::Compute);
        if (!p.gather_done) { p.gather_done = device_.newEvent(); }
        p.gather_done->record(StreamRole::AllGather);
        return fullView(p, buffer);
    }
    if (aliasesShard(p, target)) {
        useShard(p);
        return fullView(p, p.gathered);
    }
    // The compute stream may still read an old copy that the gather overwrites.
    compute_ready_->record(StreamRole::Compute);
    compute_ready_->block(StreamRole::AllGather);
    {
        auto scope = device_.use(StreamRole::AllGather);
        at::Tensor buffer = prepareBuffer(p, target);
        try {
            launch(p, buffer);
        } catch (...) {
            forget(p, /*keep_placeholder=*/false);  // never leave it marked gathered
            throw;
        }
    }
    if (!p.gather_done) { p.gather_done = device_.newEvent(); }
    p.gather_done->record(StreamRole::AllGather);
    return fullView(p, p.gathered);
}

at::Tensor Gatherer::gatherKept(ParamEntry& p, std::optional<at::ScalarType> dtype, const char* op)
{
    const bool same_dtype =
        p.gathered.defined() && p.gathered.scalar_type() == dtype.value_or(p.shard.scalar_type());
    if (p.valid && same_dtype && p.full_view.defined() &&
        p.full_view.storage().is_alias_of(p.gathered.storage())) {
        return p.full_view;
    }
    at::Tensor full = gather(p, dtype, op);
    if (p.gathered.defined() && full.storage().is_alias_of(p.gathered.storage())) {
        p.full_view = full;
    }
    return full;
}

void Gatherer::prefetch(const std::vector<ParamEntry*>& params,
                        const std::vector<std::optional<at::ScalarType>>& dtypes,
                        const char* op)
{
    std::vector<std::pair<ParamEntry*, at::ScalarType>> todo;
    for (size_t i = 0; i < params.size(); ++i) {
        ParamEntry& p = *params[i];
        DSZ_CHECK(p.partitioned, op, "ds_id ", p.ds_id, " is not a ZeRO-3 parameter");
        const at::ScalarType dtype = dtypes[i].value_or(p.shard.scalar_type());
        requireGatherDtype(p, dtype, op, comm_);
        if (p.valid && p.gathered.defined()) { continue; }
        requireShardData(p, op);
        todo.emplace_back(&p, dtype);
    }
    // Every param was checked before any is marked gathered: a refused group leaves all released.
    std::vector<std::pair<ParamEntry*, at::ScalarType>> copies;
    for (auto& entry : todo) {
        if (aliasesShard(*entry.first, entry.second)) {
            useShard(*entry.first);
        } else {
            copies.push_back(entry);
        }
    }
    todo.swap(copies);
    if (todo.empty()) { return; }
    compute_ready_->record(StreamRole::Compute);
    compute_ready_->block(StreamRole::AllGather);
    {
        auto scope = device_.use(StreamRole::AllGather);
        std::vector<at::Tensor> buffers;
        buffers.reserve(todo.size());
        for (auto& [p, dtype] : todo) { buffers.push_back(prepareBuffer(*p, dtype)); }
        try {
            CommGroup group(comm_);
            for (size_t i = 0; i < todo.size(); ++i) { launch(*todo[i].first, buffers[i]); }
            group.end();
        } catch (...) {
            // None of the group's params may stay marked gathered: their buffers may hold
            // nothing.
            for (auto& [p, dtype] : todo) { forget(*p, /*keep_placeholder=*/false); }
            throw;
        }
    }
    for (auto& [p, dtype] : todo) {
        if (!p->gather_done) { p->gather_done = device_.newEvent(); }
        p->gather_done->record(StreamRole::AllGather);
    }
}

void Gatherer::wait(ParamEntry& p)
{
    if (p.gather_done) { p.gather_done->block(StreamRole::Compute); }
}

void Gatherer::free(ParamEntry& p, const char* op)
{
    DSZ_CHECK(p.has_gathered, op, "ds_id ", p.ds_id,
              " is not gathered: release_param without a preceding allgather_param, or a "
              "second release after its last user");
    if (p.gathered.defined() && !p.gathered_is_shard && p.gathered.storage().nbytes() > 0) {
        // Kernels queued on the compute stream may still read it.
        device_.recordStream(p.gathered, StreamRole::Compute);
        // Free the memory under every view the graph still holds.
        p.gathered.storage().unsafeGetStorageImpl()->reset();
    }
    forget(p, /*keep_placeholder=*/false);
}

void Gatherer::forget(ParamEntry& p, bool keep_placeholder)
{
    p.gathered = at::Tensor();
    p.full_view = at::Tensor();
    p.gathered_is_shard = false;
    p.has_gathered = keep_placeholder;
    p.valid = false;
}

void Gatherer::invalidateAfterStep(ParamEntry& p)
{
    if (!p.frozen) { p.valid = false; }
}

}  // namespace dsz
