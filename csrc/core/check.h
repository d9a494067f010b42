// Error checks for every path a caller can reach. Messages name the operation, the id and the bad
// value; they are built only on failure (TORCH_CHECK semantics) and surface in Python as RuntimeError.
#pragma once

#include <c10/util/Exception.h>

// DSZ_CHECK(cond, "reduce_grad", "ds_id ", id, " is frozen ...")
#define DSZ_CHECK(cond, op, ...) TORCH_CHECK((cond), "ds_z3native ", op, ": ", __VA_ARGS__)

// Unconditional failure with the same message shape.
#define DSZ_FAIL(op, ...) TORCH_CHECK(false, "ds_z3native ", op, ": ", __VA_ARGS__)
