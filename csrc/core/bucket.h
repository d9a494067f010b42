// Reduce buckets. BucketCursor is the arithmetic (capacity, fill, when to flush, when to grow);
// ReduceBucket owns the flat buffer of one dtype it describes.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>

#include "device/device.h"

namespace dsz {

class BucketCursor {
public:
    explicit BucketCursor(int64_t capacity);
    int64_t capacity() const { return capacity_; }
    int64_t used() const { return used_; }
    bool empty() const { return used_ == 0; }
    // A non-empty bucket that cannot take n more elements must be flushed first.
    bool needsFlushFor(int64_t n) const { return used_ > 0 && used_ + n > capacity_; }
    // An empty bucket smaller than n grows to n (one oversized gradient gets a bucket of its own).
    bool needsGrowFor(int64_t n) const { return used_ == 0 && n > capacity_; }
    void grow(int64_t n);
    // Reserves n elements and returns their offset. Throws when they do not fit.
    int64_t take(int64_t n);
    void reset() { used_ = 0; }

private:
    int64_t capacity_;
    int64_t used_ = 0;
};

class ReduceBucket {
public:
    ReduceBucket(int64_t capacity, at::ScalarType dtype, c10::Device device);
    BucketCursor& cursor() { return cursor_; }
    // A slice of n elements of the buffer (allocating or growing it as needed).
    at::Tensor take(int64_t n);
    at::Tensor usedRegion() const;
    int64_t allocatedBytes() const { return buffer_.defined() ? buffer_.nbytes() : 0; }
    void releaseMemory();
    // Recorded where the last flush finished reading the buffer; writers wait on it.
    std::shared_ptr<Event> drained;

private:
    BucketCursor cursor_;
    at::ScalarType dtype_;
    c10::Device device_;
    at::Tensor buffer_;
};

}  // namespace dsz
