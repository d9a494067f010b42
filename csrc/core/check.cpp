#include "core/check.h"

#include <ATen/EmptyTensor.h>

namespace dsz {

bool hasData(const at::Tensor& t)
{
    if (!t.defined()) { return false; }
    if (t.numel() == 0) { return true; }
    if (t.is_meta() || !t.has_storage()) { return false; }
    const c10::Storage& s = t.storage();
    if (s.data_ptr().get() == nullptr) { return false; }
    const size_t needed = at::detail::computeStorageNbytes(
        t.sizes(), t.strides(), t.dtype().itemsize(), static_cast<size_t>(t.storage_offset()));
    return s.nbytes() >= needed;
}

}  // namespace dsz
