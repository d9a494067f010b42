// ds_z3native._C: DeepSpeed's dc module functions (same names, same argument order) plus ours
// (frozen flags, current_graph_task_id, build and runtime introspection). Importing it registers
// the dc ops.
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/extension.h>
#include <torch/version.h>

#include <optional>
#include <string>
#include <vector>

#include "backends.h"
#include "core/check.h"
#include "runtime.h"
#ifdef DSZ_WITH_CUDA
#include <cuda_runtime_api.h>
#include "comm/nccl_collectives.h"
#include "device/cuda_device.h"
#endif

#ifndef DSZ_ARCH_LIST
#define DSZ_ARCH_LIST ""
#endif
#ifndef DSZ_TORCH_VERSION
#define DSZ_TORCH_VERSION ""
#endif
// Set by setup.py: where the CUDA runtime came from ("toolkit" or "wheels"), and for a CPU
// build why it has no CUDA (a key of build_support/cuda_discovery.py's CPU_REASONS).
#ifndef DSZ_CUDA_SOURCE
#define DSZ_CUDA_SOURCE ""
#endif
#ifndef DSZ_CPU_REASON
#define DSZ_CPU_REASON ""
#endif

namespace py = pybind11;
using dsz::Runtime;
using dsz::current_runtime::get;

namespace {

// Functions that take the runtime's lock run without the GIL (see python_gil.h).
#define NO_GIL py::call_guard<py::gil_scoped_release>()

template <typename Fn>
auto withoutGil(Fn&& fn)
{
    py::gil_scoped_release no_gil;
    return fn();
}

// DeepSpeed's CompileConfig (a pydantic model). Attributes missing in older releases default.
template <typename T>
T configValue(const py::object& config, const char* name, T fallback)
{
    if (config.is_none() || !py::hasattr(config, name)) { return fallback; }
    py::object v = config.attr(name);
    if (v.is_none()) { return fallback; }
    return v.cast<T>();
}

void init(const c10::intrusive_ptr<c10d::ProcessGroup>& pg, const py::object& config,
          int64_t initial_reduce_bucket_size)
{
    dsz::RuntimeConfig c;
    c.reduce_bucket_size = initial_reduce_bucket_size;
    c.double_buffer = configValue<bool>(config, "double_buffer", c.double_buffer);
    c.symmetric_memory = configValue<bool>(config, "symmetric_memory", c.symmetric_memory);
    c.free_activation_threshold =
        configValue<int64_t>(config, "free_activation_threshold", c.free_activation_threshold);
    c.sync_before_reduce = configValue<bool>(config, "sync_before_reduce", false);
    c.sync_after_reduce = configValue<bool>(config, "sync_after_reduce", false);
    c.sync_before_allgather = configValue<bool>(config, "sync_before_allgather", false);
    c.sync_after_allgather = configValue<bool>(config, "sync_after_allgather", false);
    c.offload_activation_pin_memory =
        configValue<bool>(config, "offload_activation_pin_memory", c.offload_activation_pin_memory);
    // Set by ds_z3native's settings (set_default_persistence_budget), not by DeepSpeed's config.
    c.persistence_budget_bytes = dsz::current_runtime::defaults().persistence_budget_bytes;
    // A refused init() keeps the live runtime: everything that can be checked before the new
    // backends exist is checked first.
    Runtime::checkConfig(c);
    dsz::checkBackends(pg);
    // Without the GIL: an NCCL group's init waits on the other ranks, and ending the old runtime
    // may wait on its communicator.
    py::gil_scoped_release no_gil;
    // A second init() replaces the first: its communicator and buffers are released first (once
    // the calls still running on it have returned).
    dsz::current_runtime::destroy();
    dsz::Backends b = dsz::makeBackends(pg);
    dsz::current_runtime::replace(
        std::make_shared<Runtime>(std::move(b.comm), std::move(b.device), c));
}

py::dict persistenceInfo()
{
    const Runtime::PersistenceUse u =
        withoutGil([] { return get("persistence_info")->persistenceUse(); });
    py::dict d;
    d["budget_bytes"] = u.budget_bytes ? py::object(py::int_(*u.budget_bytes)) : py::object(py::none());
    d["selected_bytes"] = u.selected_bytes;
    d["selected"] = u.selected;
    d["declined"] = u.declined;
    return d;
}

at::Tensor orUndefined(const std::optional<at::Tensor>& t) { return t ? *t : at::Tensor(); }

py::dict buildInfo()
{
    py::dict d;
    d["flavour"] = dsz::buildFlavour();
    d["torch_version"] = std::string(DSZ_TORCH_VERSION);
    d["torch_api"] = std::to_string(TORCH_VERSION_MAJOR) + "." + std::to_string(TORCH_VERSION_MINOR);
    d["arch_list"] = std::string(DSZ_ARCH_LIST);
    const std::string cuda_source(DSZ_CUDA_SOURCE);
    const std::string cpu_reason(DSZ_CPU_REASON);
    d["cuda_source"] = cuda_source.empty() ? py::object(py::none()) : py::object(py::str(cuda_source));
    d["cpu_reason"] = cpu_reason.empty() ? py::object(py::none()) : py::object(py::str(cpu_reason));
#ifdef DSZ_WITH_CUDA
    d["cuda_version"] = std::to_string(CUDART_VERSION / 1000) + "." +
                        std::to_string((CUDART_VERSION % 1000) / 10);
    const int nccl = dsz::ncclVersionCode();
    d["nccl_version"] = std::to_string(nccl / 10000) + "." + std::to_string((nccl % 10000) / 100) +
                        "." + std::to_string(nccl % 100);
#else
    d["cuda_version"] = py::none();
    d["nccl_version"] = py::none();
#endif
#ifdef NDEBUG
    d["debug"] = false;
#else
    d["debug"] = true;
#endif
    return d;
}

py::dict commStats()
{
    const dsz::CommStats s = withoutGil([] { return get("comm_stats")->stats(); });
    py::dict d;
    d["allgather_calls"] = s.allgather_calls;
    d["allgather_bytes"] = s.allgather_bytes;
    d["reduce_scatter_calls"] = s.reduce_scatter_calls;
    d["reduce_scatter_bytes"] = s.reduce_scatter_bytes;
    d["allreduce_calls"] = s.allreduce_calls;
    d["allreduce_bytes"] = s.allreduce_bytes;
    d["bucket_flushes"] = s.bucket_flushes;
    d["reduce_bucket_bytes"] = s.reduce_bucket_bytes;
    return d;
}

py::dict paramState(int64_t ds_id)
{
    const Runtime::ParamState s =
        withoutGil([&] { return get("param_state")->paramState(ds_id); });
    py::dict d;
    d["frozen"] = s.frozen;
    d["persistent"] = s.persistent;
    d["partitioned"] = s.partitioned;
    d["gathered"] = s.gathered;
    d["valid"] = s.valid;
    d["grad_accumulated"] = s.grad_accumulated;
    d["numel"] = s.numel;
    d["shard_numel"] = s.shard_numel;
    d["grad_numel"] = s.grad_numel;
    return d;
}

py::dict runtimeInfo()
{
    std::shared_ptr<Runtime> rt = get("runtime_info");
    py::dict d;
    d["rank"] = rt->rank();
    d["world_size"] = rt->worldSize();
    d["collectives"] = std::string(rt->commName());
    d["device"] = std::string(rt->deviceName());
    d["graphs"] = withoutGil([&] { return rt->graphIds(); });
    d["pending_gradients"] = withoutGil([&] { return rt->pendingGradients(); });
    return d;
}

}  // namespace

PYBIND11_MODULE(_C, m)
{
    m.doc() = "ds_z3native native layer: a hardened drop-in for deepspeed.ops.dc_op";

    // --- DeepSpeed's functions ---
    m.def("init", &init, py::arg("process_group"), py::arg("config"),
          py::arg("initial_reduce_bucket_size"),
          "Create the runtime over a process group (replaces an earlier one).");
    m.def("cleanup", [] { dsz::current_runtime::destroy(); }, NO_GIL,
          "End the runtime and release its communicator and buffers (once the calls running on "
          "it have returned); safe to call again.");
    m.def("reset", [] {
        if (std::shared_ptr<Runtime> rt = dsz::current_runtime::tryGet()) { rt->reset(); }
    }, NO_GIL, "Drop every graph executor (before a recompile); params stay registered.");
    m.def("register_z3_param",
          [](int64_t ds_id, const std::vector<int64_t>& ds_shape, const at::Tensor& ds_tensor,
             const std::optional<at::Tensor>& grad_buffer, bool persistent,
             std::optional<at::ScalarType> expected_grad_dtype) {
              get("register_z3_param")->registerZ3Param(ds_id, ds_shape, ds_tensor,
                                                       orUndefined(grad_buffer), persistent,
                                                       expected_grad_dtype);
          },
          py::arg("ds_id"), py::arg("ds_shape"), py::arg("ds_tensor"), py::arg("grad_buffer"),
          py::arg("persistent").noconvert(), py::arg("expected_grad_dtype") = py::none(), NO_GIL,
          "Register a ZeRO-3 param. An empty or None grad_buffer registers it frozen.");
    m.def("register_graph_z3",
          [](int64_t graph_id, const std::vector<int64_t>& ds_ids) {
              get("register_graph_z3")->registerGraph(graph_id, ds_ids, dsz::ZeroStage::Z3);
          },
          py::arg("graph_id"), py::arg("ds_ids"), NO_GIL);
    m.def("register_param",
          [](int64_t ds_id, const std::vector<int64_t>& ds_shape, const at::Tensor& param,
             const std::optional<at::Tensor>& grad_buffer, int64_t offset) {
              get("register_param")->registerParam(ds_id, ds_shape, param, orUndefined(grad_buffer),
                                                  offset);
          },
          py::arg("ds_id"), py::arg("ds_shape"), py::arg("param"), py::arg("grad_buffer"),
          py::arg("offset"), NO_GIL, "Register a ZeRO-1/2 param.");
    m.def("update_param_grad_buffer",
          [](int64_t ds_id, const std::optional<at::Tensor>& grad_buffer, int64_t offset) {
              get("update_param_grad_buffer")->updateParamGradBuffer(ds_id, orUndefined(grad_buffer),
                                                                    offset);
          },
          py::arg("ds_id"), py::arg("grad_buffer"), py::arg("offset"), NO_GIL);
    m.def("register_graph_z1",
          [](int64_t graph_id, const std::vector<int64_t>& ds_ids) {
              get("register_graph_z1")->registerGraph(graph_id, ds_ids, dsz::ZeroStage::Z1);
          },
          py::arg("graph_id"), py::arg("ds_ids"), NO_GIL);
    m.def("register_graph_z2",
          [](int64_t graph_id, const std::vector<int64_t>& ds_ids) {
              get("register_graph_z2")->registerGraph(graph_id, ds_ids, dsz::ZeroStage::Z2);
          },
          py::arg("graph_id"), py::arg("ds_ids"), NO_GIL);
    m.def("set_persistent", [](int64_t ds_id) { get("set_persistent")->setPersistent(ds_id); },
          py::arg("ds_id"), NO_GIL,
          "Keep a param gathered (gathers it now if needed).");
    m.def("start_forward", [] { get("start_forward")->startForward(); }, NO_GIL);
    m.def("end_forward", [] { get("end_forward")->endForward(); }, NO_GIL);
    m.def("start_backward", [](bool update) { get("start_backward")->startBackward(update); },
          py::arg("update").noconvert(), NO_GIL);
    m.def("enable_profiling", [](bool enable) { get("enable_profiling")->enableProfiling(enable); },
          py::arg("enable").noconvert(), NO_GIL);
    m.def("is_profiling", [] { return get("is_profiling")->isProfiling(); }, NO_GIL);
    m.def("invalidate_gathered_param",
          [](int64_t ds_id) { get("invalidate_gathered_param")->invalidateGatheredParam(ds_id); },
          py::arg("ds_id"), NO_GIL);
    m.def("clear_all_gathered_params",
          [] { get("clear_all_gathered_params")->clearAllGatheredParams(); }, NO_GIL);

    // --- ours ---
    m.def("set_param_frozen",
          [](int64_t ds_id, bool frozen) { get("set_param_frozen")->setParamFrozen(ds_id, frozen); },
          py::arg("ds_id"), py::arg("frozen").noconvert(), NO_GIL,
          "Mark a param frozen (never reduced; a gradient for it is an error) or trainable.");
    m.def("is_param_frozen", [](int64_t ds_id) { return get("is_param_frozen")->isParamFrozen(ds_id); },
          py::arg("ds_id"), NO_GIL);
    m.def("current_graph_task_id", [] { return torch::autograd::get_current_graph_task_id(); },
          "The autograd engine's current graph task id; -1 outside backward.");
    m.def("build_info", &buildInfo, "How this extension was built.");
    m.def("is_initialized", [] { return dsz::current_runtime::tryGet() != nullptr; }, NO_GIL);
    m.def("runtime_info", &runtimeInfo, "Rank, world size and backends of the live runtime.");
    m.def("set_persistence_budget",
          [](std::optional<int64_t> bytes) { get("set_persistence_budget")->setPersistenceBudget(bytes); },
          py::arg("bytes"), NO_GIL,
          "Bytes DeepCompile's selective gather (set_persistent) may keep gathered in the live "
          "runtime; None = no limit. init() starts from set_default_persistence_budget's value.");
    m.def("set_default_persistence_budget",
          [](std::optional<int64_t> bytes) {
              dsz::current_runtime::setDefaults(dsz::RuntimeDefaults{bytes},
                                                "set_default_persistence_budget");
          },
          py::arg("bytes"), NO_GIL,
          "The persistence budget in bytes every later init() starts with (None = no limit; kept "
          "across cleanup()). ds_z3native's settings set it (ds_z3native.set_persistence_budget, "
          "DS_Z3NATIVE_PERSISTENCE_BUDGET_MB).");
    m.def("persistence_info", &persistenceInfo,
          "The set_persistent budget and what it kept: budget_bytes, selected_bytes, selected, "
          "declined.");
    m.def("comm_stats", &commStats, "Collectives issued since init() or reset_comm_stats().");
    m.def("reset_comm_stats", [] { get("reset_comm_stats")->resetStats(); }, NO_GIL);
    m.def("param_state", &paramState, py::arg("ds_id"), "One param's flags and sizes.");
    m.def("alias_graph",
          [](int64_t alias_id, int64_t graph_id) { get("alias_graph")->aliasGraph(alias_id, graph_id); },
          py::arg("alias_id"), py::arg("graph_id"), NO_GIL,
          "A second id for a registered graph, resolved by every dc op taking a graph_id; "
          "dropped by reset().");
    m.def("graph_aliases", [] { return withoutGil([] { return get("graph_aliases")->graphAliases(); }); },
          "The graph aliases: {alias_id: graph_id}.");

#ifdef DSZ_WITH_CUDA
    m.def("cuda_allocated_bytes",
          [](int64_t device) {
              const dsz::AllocatedBytes b = dsz::cudaAllocatedBytes(device);
              return py::make_tuple(b.current, b.peak);
          },
          py::arg("device"),
          "(torch.cuda.memory_allocated(device), torch.cuda.max_memory_allocated(device)) in one "
          "read of the caching allocator's counters (CUDA build only).");
#endif

    // The runtime may hold a process group: release it while the interpreter is still alive.
    py::module_::import("atexit").attr("register")(
        py::cpp_function([] { dsz::current_runtime::destroy(); }));
}
