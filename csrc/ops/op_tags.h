// The tags every op of ds_z3native._C is defined with (dc::* and ds_z3native::*).
#pragma once

#include <ATen/core/enum_tag.h>
#include <torch/version.h>

#include <vector>

namespace dsz::ops {

// cudagraph_unsafe: each op reads or changes host-side state (the param registry, the executor's
// use counts, a collective launched on another stream), which a CUDA graph's replay would skip
// while replaying the op's device work. With the tag, inductor keeps a graph that calls one out of
// CUDA graphs (triton.cudagraphs), or with graph_partition records only the stretches between the
// calls. Tags are not part of the schema: DeepSpeed's interface text is unchanged.
// A const reference on purpose: torch::Library::def(schema, tags) takes `const std::vector<at::Tag>&`,
// and a temporary vector would bind to def's (name, kernel) template instead.
inline const std::vector<at::Tag>& hostStatefulOpTags()
{
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 9)
    static const std::vector<at::Tag> tags{at::Tag::cudagraph_unsafe};
#else
    static const std::vector<at::Tag> tags;  // the tag and graph partitions came with torch 2.9
#endif
    return tags;
}

}  // namespace dsz::ops
