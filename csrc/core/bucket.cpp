#include "core/bucket.h"

#include <ATen/ops/empty.h>

#include "core/check.h"

namespace dsz {

BucketCursor::BucketCursor(int64_t capacity) : capacity_(capacity)
{
    DSZ_CHECK(capacity >= 1, "reduce_bucket", "capacity must be >= 1 element, got ", capacity);
}

void BucketCursor::grow(int64_t n)
{
    DSZ_CHECK(used_ == 0, "reduce_bucket", "cannot grow a bucket holding ", used_, " elements");
    if (n > capacity_) { capacity_ = n; }
}

int64_t BucketCursor::take(int64_t n)
{
    DSZ_CHECK(n >= 0, "reduce_bucket", "cannot take ", n, " elements");
    DSZ_CHECK(used_ + n <= capacity_, "reduce_bucket", "taking ", n, " elements overflows the bucket (",
              used_, " of ", capacity_, " used)");
    const int64_t offset = used_;
    used_ += n;
    return offset;
}

ReduceBucket::ReduceBucket(int64_t capacity, at::ScalarType dtype, c10::Device device)
    : cursor_(capacity), dtype_(dtype), device_(device)
{
}

at::Tensor ReduceBucket::take(int64_t n)
{
    if (cursor_.needsGrowFor(n)) { cursor_.grow(n); }
    const int64_t offset = cursor_.take(n);
    if (!buffer_.defined() || buffer_.numel() < cursor_.capacity()) {
        // Allocated lazily and only while the bucket is empty, so no queued slice is lost.
        DSZ_CHECK(offset == 0, "reduce_bucket", "internal: buffer resized while in use");
        buffer_ = at::empty({cursor_.capacity()}, at::TensorOptions().dtype(dtype_).device(device_));
    }
    return buffer_.narrow(0, offset, n);
}

at::Tensor ReduceBucket::usedRegion() const
{
    if (!buffer_.defined()) { return at::Tensor(); }
    return buffer_.narrow(0, 0, cursor_.used());
}

void ReduceBucket::releaseMemory()
{
    buffer_ = at::Tensor();
    cursor_.reset();
}

}  // namespace dsz
