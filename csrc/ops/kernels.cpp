#include "ops/kernels.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "core/check.h"
#include "python_gil.h"
#include "runtime.h"

namespace dsz::ops {

using current_runtime::get;

namespace {

// The bytes of the storage under `t` ([begin, end); empty when it holds none).
std::pair<std::uintptr_t, std::uintptr_t> storageBytes(const at::Tensor& t)
{
    if (!t.defined() || !t.has_storage()) { return {0, 0}; }
    const c10::Storage& s = t.storage();
    const auto begin = reinterpret_cast<std::uintptr_t>(s.data());
    return {begin, begin + s.nbytes()};
}

}  // namespace

at::Tensor disjointFromInputs(const at::Tensor& out, at::TensorList inputs)
{
    const auto [ob, oe] = storageBytes(out);
    if (ob == oe) { return out; }
    for (const at::Tensor& in : inputs) {
        const auto [ib, ie] = storageBytes(in);
        if (ib < ie && ib < oe && ob < ie) { return out.clone(); }
    }
    return out;
}

at::Tensor allgather_param(const at::Tensor& a, int64_t graph_id, int64_t id,
                           std::optional<at::ScalarType> dtype)
{
    GilReleasedIfHeld no_gil;  // see python_gil.h
    return disjointFromInputs(get("allgather_param")->allgatherParam(graph_id, id, dtype), a);
}

void prefetch_params_fused(int64_t graph_id, at::TensorList params, at::IntArrayRef ids,
                           std::optional<std::vector<at::ScalarType>> dtypes)
{
    DSZ_CHECK(params.size() == ids.size(), "prefetch_params_fused", "graph ", graph_id, ": ",
              params.size(), " params but ", ids.size(), " ids");
    GilReleasedIfHeld no_gil;  // see python_gil.h
    get("prefetch_params_fused")->prefetchParamsFused(graph_id, ids.vec(), dtypes);
}

at::Tensor wait_allgather(const at::Tensor& a, int64_t graph_id, int64_t id)
{
    GilReleasedIfHeld no_gil;  // see python_gil.h
    get("wait_allgather")->waitAllgather(graph_id, id);
    return a;
}

at::Tensor release_param(const at::Tensor& a, int64_t graph_id, int64_t id, int64_t n_users)
{
    GilReleasedIfHeld no_gil;  // see python_gil.h
    get("release_param")->releaseParam(graph_id, id, n_users);
    return a;
}

at::Tensor reduce_grad(const at::Tensor& a, int64_t graph_id, int64_t id)
{
    GilReleasedIfHeld no_gil;  // see python_gil.h
    get("reduce_grad")->reduceGrad(graph_id, id, a);
    return at::empty({0}, a.options());
}

void free_tensors(at::TensorList a)
{
    GilReleasedIfHeld no_gil;  // see python_gil.h
    get("free_tensors")->freeTensors(a.vec());
}

// Activation offload. The values travel through the runtime (the host copy, the reloaded
// buffer); offload_tensor, wait_offload and reload_tensor return a stand-in shaped like the
// activation, which carries the graph's order from one op to the next. So no output shares memory
// with an input (DeepSpeed's kernels return the buffer their input already is, which torch's
// custom-op contract forbids), and what each op returns is what its Meta kernel says.
at::Tensor standIn(const at::Tensor& like)
{
    return at::zeros({}, like.options()).expand(like.sizes());
}

at::Tensor offload_tensor(const at::Tensor& a, int64_t graph_id, int64_t id)
{
    {
        GilReleasedIfHeld no_gil;  // see python_gil.h
        get("offload_tensor")->offloadTensor(a, graph_id, id);
    }
    return standIn(a);
}

at::Tensor reload_tensor(const at::Tensor& a, int64_t graph_id, int64_t id)
{
    {
        GilReleasedIfHeld no_gil;  // see python_gil.h
        get("reload_tensor")->reloadTensor(graph_id, id);
    }
    return standIn(a);
}

at::Tensor wait_offload(const at::Tensor& a, int64_t graph_id, int64_t id)
{
    {
        GilReleasedIfHeld no_gil;  // see python_gil.h
        get("wait_offload")->waitOffload(graph_id, id);
    }
    return standIn(a);
}

// The reloaded activation, contiguous (the host copy is); a fresh copy of `a` while profiling
// when nothing was reloaded.
at::Tensor wait_reload(const at::Tensor& a, int64_t graph_id, int64_t id)
{
    at::Tensor out;
    {
        GilReleasedIfHeld no_gil;  // see python_gil.h
        out = get("wait_reload")->waitReload(a, graph_id, id);
    }
    if (out.is_same(a)) { return at::empty(a.sizes(), a.options()).copy_(a); }
    DSZ_CHECK(out.sizes().equals(a.sizes()), "wait_reload", "activation id ", id, " of graph ",
              graph_id, " was offloaded with shape ", out.sizes(), " but is waited for as ",
              a.sizes());
    return out;
}

void offload_parameter(const at::Tensor&, int64_t graph_id, int64_t id)
{
    GilReleasedIfHeld no_gil;  // see python_gil.h
    get("offload_parameter")->offloadParameter(graph_id, id);
}

void reload_parameter(const at::Tensor&, int64_t graph_id, int64_t id)
{
    GilReleasedIfHeld no_gil;  // see python_gil.h
    get("reload_parameter")->reloadParameter(graph_id, id);
}

namespace {

// The dispatcher never looks inside `Any`, so this kernel (registered for the catch-all key) is
// also what runs while FakeTensorMode traces a graph. A trace must not flush, release or
// invalidate the real runtime's state: deps holding fake tensors (Python key) mark one.
// DeepSpeed's deps are the reduce_grad outputs of the graph (compile/fx.py add_end_backward),
// real tensors or None in a run; a plain meta tensor outside a trace stands for a gradient that
// was never reduced (reduce_grad refuses meta gradients), so it is refused rather than taken for
// a trace, which would skip the flush. `path` names the offending element, e.g. "deps[1]".
struct DepsKind {
    bool fake = false;
    std::string plain_meta;  // path of the first plain meta tensor, empty if none
    std::vector<int64_t> plain_meta_sizes;
};

void scanDeps(const c10::IValue& deps, const std::string& path, DepsKind& kind)
{
    if (deps.isTensor()) {
        const at::Tensor& t = deps.toTensor();
        if (!t.defined()) { return; }
        if (t.key_set().has(c10::DispatchKey::Python)) {
            kind.fake = true;
        } else if (t.is_meta() && kind.plain_meta.empty()) {
            kind.plain_meta = path;
            kind.plain_meta_sizes = t.sizes().vec();
        }
        return;
    }
    if (deps.isTensorList()) {
        const std::vector<at::Tensor> items = deps.toTensorList().vec();
        for (size_t i = 0; i < items.size(); ++i) {
            scanDeps(c10::IValue(items[i]), path + "[" + std::to_string(i) + "]", kind);
        }
        return;
    }
    if (deps.isList() || deps.isTuple()) {
        c10::ArrayRef<c10::IValue> items =
            deps.isList() ? deps.toListRef() : c10::ArrayRef<c10::IValue>(deps.toTupleRef().elements());
        for (size_t i = 0; i < items.size(); ++i) {
            scanDeps(items[i], path + "[" + std::to_string(i) + "]", kind);
        }
    }
}

}  // namespace

void end_backward(const c10::IValue& deps, int64_t graph_id, bool release_reduce_buckets)
{
    DepsKind kind;
    scanDeps(deps, "deps", kind);
    if (kind.fake) { return; }  // a trace
    DSZ_CHECK(kind.plain_meta.empty(), "end_backward", "graph_id ", graph_id, ": ",
              kind.plain_meta, " is a meta tensor (shape ", c10::IntArrayRef(kind.plain_meta_sizes),
              ") outside a fake-tensor trace: DeepCompile passes the graph's reduce_grad outputs, "
              "real tensors or None; a meta one stands for a gradient that was never reduced, "
              "so the backward cannot be ended (nothing was flushed)");
    GilReleasedIfHeld no_gil;  // see python_gil.h
    get("end_backward")->endBackward(graph_id, release_reduce_buckets);
}

// DeepSpeed's debug op: kept for the schema, prints nothing.
at::Tensor test_call(const at::Tensor& a)
{
    DSZ_CHECK(hasData(a), "test_call", "the tensor of shape ", a.sizes(),
              " has no data (its storage was freed, e.g. by release_param)");
    return a.clone();
}

// ------------------------------------------------------------------ Meta

at::Tensor allgather_param_meta(const at::Tensor&, int64_t, int64_t id,
                                std::optional<at::ScalarType> dtype)
{
    GilReleasedIfHeld no_gil;  // see python_gil.h
    return get("allgather_param (meta)")->gatheredMeta(id, dtype);
}

void prefetch_params_fused_meta(int64_t graph_id, at::TensorList params, at::IntArrayRef ids,
                                std::optional<std::vector<at::ScalarType>>)
{
    DSZ_CHECK(params.size() == ids.size(), "prefetch_params_fused (meta)", "graph ", graph_id,
              ": ", params.size(), " params but ", ids.size(), " ids");
}

// The ds_id checks of the device kernels, for the Meta kernels: a trace (fake tensors) and a call
// with real meta tensors see the same unknown-id errors as a run.
void requireParamMeta(int64_t id, const char* op)
{
    GilReleasedIfHeld no_gil;  // see python_gil.h
    get(op)->requireParam(id, op);
}

// A meta tensor outside a trace: a FakeTensorMode trace hands the Meta kernels fake tensors
// (Python key set); plain meta tensors hold no values.
bool plainMeta(const at::Tensor& t)
{
    return t.defined() && t.is_meta() && !t.key_set().has(c10::DispatchKey::Python);
}

at::Tensor wait_allgather_meta(const at::Tensor& a, int64_t, int64_t id)
{
    requireParamMeta(id, "wait_allgather (meta)");
    return a;
}

at::Tensor release_param_meta(const at::Tensor& a, int64_t, int64_t id, int64_t n_users)
{
    requireParamMeta(id, "release_param (meta)");
    DSZ_CHECK(n_users >= 1, "release_param (meta)", "n_users must be >= 1 for ds_id ", id,
              ", got ", n_users);
    return a;
}

at::Tensor reduce_grad_meta(const at::Tensor& a, int64_t, int64_t id)
{
    requireParamMeta(id, "reduce_grad (meta)");
    // Outside a trace a meta gradient would be dropped without a word: it has no values.
    DSZ_CHECK(!plainMeta(a), "reduce_grad (meta)", "gradient of ds_id ", id, " (shape ",
              a.sizes(), ") is a meta tensor: it holds no values to reduce");
    return at::empty({0}, a.options());
}
void free_tensors_meta(at::TensorList) {}
at::Tensor stand_in_meta(const at::Tensor& a, int64_t, int64_t)
{
    return at::empty({}, a.options()).expand(a.sizes());
}
at::Tensor contiguous_meta(const at::Tensor& a, int64_t, int64_t)
{
    return at::empty(a.sizes(), a.options());
}
void offload_parameter_meta(const at::Tensor&, int64_t, int64_t id)
{
    requireParamMeta(id, "offload_parameter (meta)");
}
void reload_parameter_meta(const at::Tensor&, int64_t, int64_t id)
{
    requireParamMeta(id, "reload_parameter (meta)");
}
void end_backward_meta(const c10::IValue&, int64_t, bool) {}
at::Tensor test_call_meta(const at::Tensor& a) { return at::empty_like(a); }

}  // namespace dsz::ops
