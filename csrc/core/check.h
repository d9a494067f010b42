// Error checks for every path a caller can reach. Messages name the operation, the id and the bad
// value; they are built only on failure (TORCH_CHECK semantics) and surface in Python as RuntimeError.
#pragma once

#include <c10/util/Exception.h>

// DSZ_CHECK(cond, "reduce_grad", "ds_id ", id, " is frozen ...")
#define DSZ_CHECK(cond, op, ...) TORCH_CHECK((cond), "ds_z3native ", op, ": ", __VA_ARGS__)

// Unconditional failure with the same message shape.
#define DSZ_FAIL(op, ...) TORCH_CHECK(false, "ds_z3native ", op, ": ", __VA_ARGS__)

#include <ATen/core/Tensor.h>

namespace dsz {

// True when t's elements can be read: it is defined and either has no elements or is backed by
// storage that holds them. A buffer freed in place (release_param frees the gathered copy under
// every view of it) keeps its sizes but loses its memory: reading it would be a wild read.
bool hasData(const at::Tensor& t);

}  // namespace dsz
