#include "harness.h"

#include <ATen/Parallel.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <limits>
#include <mutex>
#include <thread>

#include "device/device.h"

namespace dsz::test {

RuntimeConfig smallConfig(int64_t bucket_elements, bool double_buffer)
{
    RuntimeConfig c;
    c.reduce_bucket_size = bucket_elements;
    c.double_buffer = double_buffer;
    return c;
}

void Barrier::wait()
{
    std::unique_lock<std::mutex> lock(mu_);
    const int64_t gen = generation_;
    if (++arrived_ == n_) {
        arrived_ = 0;
        ++generation_;
        cv_.notify_all();
        return;
    }
    cv_.wait(lock, [&] { return generation_ != gen; });
}

void runRanks(const std::shared_ptr<LoopbackWorld>& world, const RuntimeConfig& config,
              const RankFn& fn)
{
    const int64_t n = world->size();
    std::mutex mu;
    std::condition_variable cv;
    int64_t finished = 0;
    std::vector<std::string> errors(n);
    std::vector<std::thread> threads;
    threads.reserve(n);
    for (int64_t r = 0; r < n; ++r) {
        threads.emplace_back([&, r] {
            SCOPED_TRACE("rank " + std::to_string(r));
            try {
                Runtime rt(makeLoopbackCollectives(world, r), makeHostDevice(), config);
                fn(r, rt);
            } catch (const c10::Error& e) {
                errors[r] = e.what_without_backtrace();
            } catch (const std::exception& e) {
                errors[r] = e.what();
            }
            std::lock_guard<std::mutex> lock(mu);
            ++finished;
            cv.notify_all();
        });
    }
    {
        std::unique_lock<std::mutex> lock(mu);
        if (!cv.wait_for(lock, std::chrono::seconds(60), [&] { return finished == n; })) {
            std::fprintf(stderr,
                         "FATAL: only %lld of %lld simulated ranks finished within 60 s: a "
                         "collective was not joined by every rank\n",
                         static_cast<long long>(finished), static_cast<long long>(n));
            std::fflush(stderr);
            std::_Exit(3);
        }
    }
    for (auto& t : threads) { t.join(); }
    for (int64_t r = 0; r < n; ++r) {
        if (!errors[r].empty()) { ADD_FAILURE() << "rank " << r << " threw: " << errors[r]; }
    }
}

void runRanks(int64_t world_size, const RuntimeConfig& config, const RankFn& fn)
{
    runRanks(std::make_shared<LoopbackWorld>(world_size), config, fn);
}

int64_t numelOf(const std::vector<int64_t>& shape)
{
    int64_t n = 1;
    for (int64_t d : shape) { n *= d; }
    return n;
}

std::vector<int64_t> idsFor(size_t n, int64_t first)
{
    std::vector<int64_t> ids;
    for (size_t i = 0; i < n; ++i) { ids.push_back(first + static_cast<int64_t>(i)); }
    return ids;
}

static at::TensorOptions f32() { return at::TensorOptions().dtype(at::kFloat); }

at::Tensor zerosF(int64_t n) { return at::zeros({n}, f32()); }
at::Tensor emptyF(int64_t n) { return at::empty({n}, f32()); }
at::Tensor nanF(int64_t n) { return at::full({n}, std::numeric_limits<float>::quiet_NaN(), f32()); }

at::Tensor fullParam(int64_t ds_id, const std::vector<int64_t>& shape)
{
    const int64_t n = numelOf(shape);
    // Small integers and halves: exact in float32, distinct per element and per id.
    return at::arange(n, f32()).mul(0.5).add(static_cast<double>(1000 * ds_id + 1)).view(shape);
}

at::Tensor shardOf(const at::Tensor& full, const ShardLayout& layout, int64_t rank)
{
    const at::Tensor flat = full.reshape({-1});
    at::Tensor padded =
        at::cat({flat, at::zeros({layout.padding()}, flat.options())});
    return padded.narrow(0, layout.shardBegin(rank), layout.per_rank).clone();
}

at::Tensor rankGrad(int64_t ds_id, const std::vector<int64_t>& shape, int64_t rank, int64_t step)
{
    const int64_t n = numelOf(shape);
    return at::arange(n, f32())
        .add(1.0)
        .mul(static_cast<double>(rank + 1))
        .add(static_cast<double>(10 * ds_id + 100 * step))
        .view(shape);
}

at::Tensor meanGrad(int64_t ds_id, const std::vector<int64_t>& shape, int64_t world_size,
                    int64_t step)
{
    at::Tensor sum = at::zeros({numelOf(shape)}, f32());
    for (int64_t r = 0; r < world_size; ++r) {
        sum.add_(rankGrad(ds_id, shape, r, step).reshape({-1}));
    }
    return sum.div(static_cast<double>(world_size));
}

at::Tensor registerZ3(Runtime& rt, int64_t ds_id, const std::vector<int64_t>& shape, bool frozen,
                      bool persistent)
{
    const ShardLayout l = ShardLayout::of(numelOf(shape), rt.worldSize());
    at::Tensor grad = frozen ? at::Tensor() : emptyF(l.per_rank).fill_(-7.0f);
    rt.registerZ3Param(ds_id, shape, shardOf(fullParam(ds_id, shape), l, rt.rank()), grad,
                       persistent, std::nullopt);
    return grad;
}

::testing::AssertionResult throwsNaming(const std::function<void()>& fn,
                                        const std::vector<std::string>& needles)
{
    try {
        fn();
    } catch (const c10::Error& e) {
        const std::string msg = e.what_without_backtrace();
        for (const std::string& needle : needles) {
            if (msg.find(needle) == std::string::npos) {
                return ::testing::AssertionFailure()
                       << "message does not contain \"" << needle << "\": " << msg;
            }
        }
        return ::testing::AssertionSuccess();
    } catch (const std::exception& e) {
        return ::testing::AssertionFailure() << "threw a non-c10::Error: " << e.what();
    }
    return ::testing::AssertionFailure() << "did not throw";
}

}  // namespace dsz::test

int main(int argc, char** argv)
{
    // The simulated ranks are threads already; intra-op threads would only oversubscribe 2 cores.
    at::set_num_threads(1);
    ::testing::InitGoogleTest(&argc, argv);
    return RUN_ALL_TESTS();
}
