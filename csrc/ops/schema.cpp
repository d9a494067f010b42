// The dc operator schemas, from the op list python/ds_z3native/dc_ops.def (DeepSpeed's interface,
// text for text). ds_z3native's own ops (the list's DSZ_OP lines) are defined in group_ops.cpp;
// every line's name is checked against its schema here.
#include <torch/library.h>

#include "ops/op_tags.h"

namespace {

// Whether `schema` defines the operator `name` (the list's name column and the schema's name
// can then never disagree).
constexpr bool definesOp(const char* schema, const char* name)
{
    while (*name != '\0') {
        if (*schema++ != *name++) {
            return false;
        }
    }
    return *schema == '(';
}

#define DC_OP(name, schema, meta) \
    static_assert(definesOp(schema, #name), "dc_ops.def: the schema of " #name " names another op");
#define DSZ_OP(name, schema, kernel, meta) DC_OP(name, schema, meta)
#include "ds_z3native/dc_ops.def"
#undef DC_OP
#undef DSZ_OP

}  // namespace

TORCH_LIBRARY(dc, m)
{
#define DC_OP(name, schema, meta) m.def(schema, dsz::ops::hostStatefulOpTags());
#define DSZ_OP(name, schema, kernel, meta)  // TORCH_LIBRARY(ds_z3native) in group_ops.cpp
#include "ds_z3native/dc_ops.def"
#undef DC_OP
#undef DSZ_OP
}
