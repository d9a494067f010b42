// The dc operator schemas. They are DeepSpeed's interface (0.19.0 - 0.19.8) and must match it
// exactly; end_backward's release_reduce_buckets defaults to True so 0.19.0-0.19.1's two-argument
// call still binds.
#include <torch/library.h>

TORCH_LIBRARY(dc, m)
{
    m.def("allgather_param(Tensor a, int graph_id, int id, ScalarType? dtype = None) -> Tensor");
    m.def("prefetch_params_fused(int graph_id, Tensor[] params, int[] ids, ScalarType[]? dtypes = None) -> ()");
    m.def("wait_allgather(Tensor(a) a, int graph_id, int id) -> Tensor(a)");
    m.def("release_param(Tensor(a) a, int graph_id, int id, int n_users) -> Tensor(a)");
    m.def("reduce_grad(Tensor a, int graph_id, int id) -> Tensor");
    m.def("free_tensors(Tensor[] a) -> ()");
    m.def("offload_tensor(Tensor a, int id, int id) -> Tensor");
    m.def("reload_tensor(Tensor a, int id, int id) -> Tensor");
    m.def("wait_offload(Tensor a, int id, int id) -> Tensor");
    m.def("wait_reload(Tensor a, int id, int id) -> Tensor");
    m.def("offload_parameter(Tensor a, int id, int id) -> ()");
    m.def("reload_parameter(Tensor a, int id, int id) -> ()");
    m.def("end_backward(Any deps, int graph_id, bool release_reduce_buckets = True) -> ()");
    m.def("test_call(Tensor a) -> Tensor");
}
