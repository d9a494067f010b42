// The Meta kernels (shapes only, for tracing), one per op of python/ds_z3native/dc_ops.def.
#include <torch/library.h>

#include "ops/kernels.h"

using namespace dsz::ops;

TORCH_LIBRARY_IMPL(dc, Meta, m)
{
#define DC_OP(name, schema, meta) m.impl(#name, &meta);
#define DSZ_OP(name, schema, kernel, meta)  // ds_z3native::, group_ops.cpp
#include "ds_z3native/dc_ops.def"
#undef DC_OP
#undef DSZ_OP
}
