// Gradient reduction end to end on simulated ranks: averaging into each rank's shard, padding,
// accumulation windows, bucket flushes, the frozen-param refusals (H2), padded slots (H5),
// persistence of frozen params across steps (H7), profiling, and ZeRO-1/2 graphs.
#include <ATen/ops/zeros.h>

#include "harness.h"

namespace dsz::test {
namespace {

constexpr int64_t kGraph = 200;

const std::vector<std::vector<int64_t>> kShapes = {{5}, {3, 7}, {1}, {2, 2, 3}, {13}, {4, 2}};

// Rank `rank`'s shard of the mean gradient, zero padded; `steps` are summed (accumulation).
at::Tensor expectedShard(int64_t ds_id, const std::vector<int64_t>& shape, int64_t ws,
                         int64_t rank, const std::vector<int64_t>& steps)
{
    at::Tensor sum = zerosF(numelOf(shape));
    for (int64_t s : steps) { sum.add_(meanGrad(ds_id, shape, ws, s)); }
    return shardOf(sum, ShardLayout::of(numelOf(shape), ws), rank);
}

// Checks the reduced shard against `expected` (which is zero in the padding) and for NaN.
void expectShard(const at::Tensor& grad_buffer, const at::Tensor& expected, int64_t ds_id)
{
    SCOPED_TRACE("ds_id " + std::to_string(ds_id));
    ASSERT_EQ(grad_buffer.numel(), expected.numel());
    EXPECT_FALSE(grad_buffer.isnan().any().item<bool>()) << grad_buffer;
    EXPECT_TRUE(grad_buffer.allclose(expected, 1e-6, 1e-5))
        << "got " << grad_buffer << "\nexpected " << expected;
}

void expectPaddingZero(const at::Tensor& grad_buffer, const ShardLayout& l, int64_t rank)
{
    const int64_t valid = l.validInShard(rank);
    if (valid < l.per_rank) {
        EXPECT_TRUE(grad_buffer.narrow(0, valid, l.per_rank - valid).eq(0.0f).all().item<bool>())
            << "padding of rank " << rank << " is not zero: " << grad_buffer;
    }
}

// The ZeRO-3 params of kGraph on one rank: their ds_ids, shapes and grad buffers.
struct GraphParams {
    std::vector<int64_t> ids;
    std::vector<std::vector<int64_t>> shapes;
    std::vector<at::Tensor> bufs;
};

// Registers one ZeRO-3 param per shape (ds_ids first_id, first_id + 1, ...) and kGraph over them.
GraphParams registerGraphOf(Runtime& rt, const std::vector<std::vector<int64_t>>& shapes,
                            int64_t first_id = 1)
{
    GraphParams p{idsFor(shapes.size(), first_id), shapes, {}};
    for (size_t i = 0; i < p.ids.size(); ++i) {
        p.bufs.push_back(registerZ3(rt, p.ids[i], p.shapes[i]));
    }
    rt.registerGraph(kGraph, p.ids, ZeroStage::Z3);
    return p;
}

// One backward pass in which every param gets this rank's gradient of `step`.
void backwardPass(Runtime& rt, const GraphParams& p, int64_t rank, int64_t step, bool boundary,
                  bool release_reduce_buckets)
{
    rt.startBackward(boundary);
    for (size_t i = 0; i < p.ids.size(); ++i) {
        rt.reduceGrad(kGraph, p.ids[i], rankGrad(p.ids[i], p.shapes[i], rank, step));
    }
    rt.endBackward(kGraph, release_reduce_buckets);
}

// expectShard for every param (the mean gradients of `steps`, summed) and, with
// `padding_zero`, expectPaddingZero too.
void expectShards(const GraphParams& p, int64_t ws, int64_t rank,
                  const std::vector<int64_t>& steps, bool padding_zero)
{
    for (size_t i = 0; i < p.ids.size(); ++i) {
        expectShard(p.bufs[i], expectedShard(p.ids[i], p.shapes[i], ws, rank, steps), p.ids[i]);
        if (padding_zero) {
            expectPaddingZero(p.bufs[i], ShardLayout::of(numelOf(p.shapes[i]), ws), rank);
        }
    }
}

class ReduceAtWorldSize : public ::testing::TestWithParam<int64_t> {};

TEST_P(ReduceAtWorldSize, MeanOverRanksLandsInEachShardWithZeroPadding)
{
    const int64_t ws = GetParam();
    runRanks(ws, smallConfig(), [&](int64_t rank, Runtime& rt) {
        const GraphParams p = registerGraphOf(rt, kShapes);
        backwardPass(rt, p, rank, 0, /*boundary=*/true, /*release_reduce_buckets=*/true);
        EXPECT_EQ(rt.pendingGradients(), 0u);
        expectShards(p, ws, rank, {0}, /*padding_zero=*/true);
        for (int64_t id : p.ids) { EXPECT_TRUE(rt.paramState(id).grad_accumulated); }
        const CommStats s = rt.stats();
        EXPECT_EQ(s.reduce_scatter_calls, static_cast<int64_t>(p.ids.size()));
        EXPECT_EQ(s.allreduce_calls, 0);
    });
}

TEST_P(ReduceAtWorldSize, TwoGradientsOfOneParamInOneFlushAreSummed)
{
    // Both gradients sit in the same bucket and flush together: the second must be added to
    // the first, not received over it. (A bucket is sized to all reducible slots, one per
    // trainable param: a second trainable param, never reduced, makes room for two.)
    const int64_t ws = GetParam();
    const std::vector<int64_t> shape = {3, 7};
    runRanks(ws, smallConfig(), [&](int64_t rank, Runtime& rt) {
        at::Tensor buf = registerZ3(rt, 1, shape);
        registerZ3(rt, 2, shape);
        rt.registerGraph(kGraph, {1, 2}, ZeroStage::Z3);
        rt.startBackward(true);
        rt.reduceGrad(kGraph, 1, rankGrad(1, shape, rank, 0));
        rt.reduceGrad(kGraph, 1, rankGrad(1, shape, rank, 1));
        rt.endBackward(kGraph, true);
        EXPECT_EQ(rt.stats().bucket_flushes, 1);
        expectShard(buf, expectedShard(1, shape, ws, rank, {0, 1}), 1);
    });
}

TEST_P(ReduceAtWorldSize, AccumulatesWithinAWindowAndOverwritesInTheNext)
{
    const int64_t ws = GetParam();
    runRanks(ws, smallConfig(), [&](int64_t rank, Runtime& rt) {
        const GraphParams p = registerGraphOf(rt, kShapes);
        auto pass = [&](int64_t step, bool boundary) {
            backwardPass(rt, p, rank, step, boundary, /*release_reduce_buckets=*/false);
        };
        pass(0, false);
        expectShards(p, ws, rank, {0}, /*padding_zero=*/false);
        pass(1, true);  // same window: added
        expectShards(p, ws, rank, {0, 1}, /*padding_zero=*/true);
        pass(2, true);  // the optimizer consumed the window: overwritten
        expectShards(p, ws, rank, {2}, /*padding_zero=*/false);
    });
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, ReduceAtWorldSize, ::testing::Values(1, 2, 3, 5),
                         [](const auto& info) { return "ws" + std::to_string(info.param); });

TEST(Buckets, SmallBucketsFlushEarlyAndStillReduceCorrectly)
{
    // Capacity 8 elements: several flushes per backward, one gradient (padded 15 at ws 3,
    // 14 at ws 2) larger than the whole bucket.
    const std::vector<std::vector<int64_t>> shapes = {{5}, {2}, {13}, {4}, {1}, {7}, {3}};
    for (int64_t ws : {2, 3}) {
        for (bool double_buffer : {true, false}) {
            SCOPED_TRACE("world_size " + std::to_string(ws) + " double_buffer " +
                         std::to_string(double_buffer));
            runRanks(ws, smallConfig(8, double_buffer), [&](int64_t rank, Runtime& rt) {
                const GraphParams p = registerGraphOf(rt, shapes, 10);
                for (int64_t step = 0; step < 2; ++step) {
                    backwardPass(rt, p, rank, step, /*boundary=*/step == 1,
                                 /*release_reduce_buckets=*/step == 1);
                }
                expectShards(p, ws, rank, {0, 1}, /*padding_zero=*/true);
                const CommStats s = rt.stats();
                // Did flush early: more flushes than end_backward calls.
                EXPECT_GT(s.bucket_flushes, 2 * 2);
                EXPECT_EQ(s.reduce_scatter_calls, 2 * static_cast<int64_t>(p.ids.size()));
            });
        }
    }
}

// reduce_grads (ds_z3native's op): gradients handed over in groups of three land what one
// reduce_grad per gradient lands, also where the bucket fills in the middle of a group.
TEST(Grouped, GroupsLandWhatOneCallPerGradientLandsAcrossFlushes)
{
    const std::vector<std::vector<int64_t>> shapes = {{5}, {2}, {13}, {4}, {1}, {7}, {3}};
    for (int64_t ws : {1, 2, 3}) {
        for (bool double_buffer : {true, false}) {
            SCOPED_TRACE("world_size " + std::to_string(ws) + " double_buffer " +
                         std::to_string(double_buffer));
            runRanks(ws, smallConfig(8, double_buffer), [&](int64_t rank, Runtime& rt) {
                const GraphParams p = registerGraphOf(rt, shapes, 10);
                for (int64_t step = 0; step < 2; ++step) {
                    rt.startBackward(/*boundary=*/step == 1);
                    for (size_t first = 0; first < p.ids.size(); first += 3) {
                        std::vector<int64_t> ids;
                        std::vector<at::Tensor> grads;
                        for (size_t i = first; i < std::min(first + 3, p.ids.size()); ++i) {
                            ids.push_back(p.ids[i]);
                            grads.push_back(rankGrad(p.ids[i], p.shapes[i], rank, step));
                        }
                        rt.reduceGrads(kGraph, ids, grads);
                    }
                    rt.endBackward(kGraph, /*release_reduce_buckets=*/step == 1);
                }
                expectShards(p, ws, rank, {0, 1}, /*padding_zero=*/true);
                EXPECT_EQ(rt.stats().reduce_scatter_calls, 2 * static_cast<int64_t>(p.ids.size()));
                EXPECT_GT(rt.stats().bucket_flushes, 2 * 2);  // flushed within groups
            });
        }
    }
}

// A group with one refused gradient queues none of them, issues no collective, and the runtime
// reduces the next group.
TEST(Grouped, ARefusedGroupQueuesNothing)
{
    runRanks(2, smallConfig(), [&](int64_t rank, Runtime& rt) {
        at::Tensor ok_buf = registerZ3(rt, 6001, {3, 3});
        registerZ3(rt, 6002, {5}, /*frozen=*/true);
        at::Tensor other_buf = registerZ3(rt, 6003, {4});
        rt.registerGraph(kGraph, {6001, 6002, 6003}, ZeroStage::Z3);
        rt.startBackward(true);
        const at::Tensor g1 = rankGrad(6001, {3, 3}, rank, 0);
        EXPECT_TRUE(throwsNaming(
            [&] { rt.reduceGrads(kGraph, {6001, 6002}, {g1, rankGrad(6002, {5}, rank, 0)}); },
            {"reduce_grads", "6002", "frozen"}));
        EXPECT_TRUE(throwsNaming(
            [&] { rt.reduceGrads(kGraph, {6001, 6099}, {g1, rankGrad(6099, {4}, rank, 0)}); },
            {"reduce_grads", "6099"}));
        EXPECT_TRUE(throwsNaming(
            [&] { rt.reduceGrads(kGraph, {6001, 6003}, {g1, zerosF(9)}); },
            {"reduce_grads", "6003", "9 elements"}));
        EXPECT_TRUE(throwsNaming([&] { rt.reduceGrads(kGraph, {6001}, {}); },
                                 {"reduce_grads", "0 gradients but 1 ids"}));
        EXPECT_EQ(rt.pendingGradients(), 0u);
        rt.reduceGrads(kGraph, {6001, 6003}, {g1, rankGrad(6003, {4}, rank, 0)});
        EXPECT_EQ(rt.pendingGradients(), 2u);
        rt.endBackward(kGraph, true);
        expectShard(ok_buf, expectedShard(6001, {3, 3}, 2, rank, {0}), 6001);
        expectShard(other_buf, expectedShard(6003, {4}, 2, rank, {0}), 6003);
    });
}

TEST(Buckets, NoBucketIsLargerThanAllReducibleGradients)
{
    // A configured size of 1M elements (DeepSpeed's default is 500M), two small trainable
    // params and a large frozen one (a LoRA shape): the bucket takes only the trainable slots
    // (padded 6 + 22 at ws 2), flushes as often as before, and reduces the same values.
    runRanks(2, smallConfig(1 << 20), [&](int64_t rank, Runtime& rt) {
        registerZ3(rt, 3, {1000}, /*frozen=*/true, /*persistent=*/false);
        const GraphParams p = registerGraphOf(rt, {{5}, {3, 7}}, 1);
        backwardPass(rt, p, rank, 0, /*boundary=*/true, /*release_reduce_buckets=*/true);
        expectShards(p, 2, rank, {0}, /*padding_zero=*/true);
        const CommStats s = rt.stats();
        EXPECT_EQ(s.reduce_bucket_bytes, (6 + 22) * 4);
        EXPECT_EQ(s.bucket_flushes, 1);
        EXPECT_EQ(s.reduce_scatter_calls, 2);
    });
    // One param reduced twice in a backward (a param two graphs use) overfills a bucket sized
    // for one slot each: one flush more, the same sum.
    runRanks(2, smallConfig(1 << 20), [&](int64_t rank, Runtime& rt) {
        at::Tensor buf = registerZ3(rt, 1, {3, 7});
        rt.registerGraph(kGraph, {1}, ZeroStage::Z3);
        rt.startBackward(true);
        rt.reduceGrad(kGraph, 1, rankGrad(1, {3, 7}, rank, 0));
        rt.reduceGrad(kGraph, 1, rankGrad(1, {3, 7}, rank, 1));
        rt.endBackward(kGraph, true);
        EXPECT_EQ(rt.stats().bucket_flushes, 2);
        EXPECT_EQ(rt.stats().reduce_bucket_bytes, 2 * 22 * 4);  // double buffered: both used
        expectShard(buf, expectedShard(1, {3, 7}, 2, rank, {0, 1}), 1);
    });
}

// H5: a slot is the padded length and its padding is zero. The bucket memory is first filled
// with NaN by another parameter's flush; a slot of only numel elements would make the next
// reduce-scatters read a neighbour's gradient or that stale NaN as padding.
TEST(PaddedSlots, ReduceScatterNeverReadsPastItsSlot)
{
    for (int64_t ws : {2, 3}) {
        SCOPED_TRACE("world_size " + std::to_string(ws));
        runRanks(ws, smallConfig(64, /*double_buffer=*/false), [&](int64_t rank, Runtime& rt) {
            const ShardLayout lp = ShardLayout::of(48, ws);
            at::Tensor poison_buf = registerZ3(rt, 1, {48});
            at::Tensor a_buf = registerZ3(rt, 2, {5});
            at::Tensor b_buf = registerZ3(rt, 3, {7});
            rt.registerGraph(kGraph, {1, 2, 3}, ZeroStage::Z3);

            rt.startBackward(true);
            rt.reduceGrad(kGraph, 1, nanF(48));
            rt.endBackward(kGraph, /*release_reduce_buckets=*/false);  // keep the poisoned memory
            EXPECT_TRUE(poison_buf.isnan().all().item<bool>());
            EXPECT_EQ(lp.per_rank, poison_buf.numel());

            rt.startBackward(true);
            rt.reduceGrad(kGraph, 2, rankGrad(2, {5}, rank, 0));
            rt.reduceGrad(kGraph, 3, rankGrad(3, {7}, rank, 0));
            rt.endBackward(kGraph, true);
            expectShard(a_buf, expectedShard(2, {5}, ws, rank, {0}), 2);
            expectShard(b_buf, expectedShard(3, {7}, ws, rank, {0}), 3);
            expectPaddingZero(a_buf, ShardLayout::of(5, ws), rank);
            expectPaddingZero(b_buf, ShardLayout::of(7, ws), rank);
            // Each reduce-scatter moved exactly the padded length.
            const CommStats s = rt.stats();
            const int64_t padded_total =
                lp.padded + ShardLayout::of(5, ws).padded + ShardLayout::of(7, ws).padded;
            EXPECT_EQ(s.reduce_scatter_bytes, 4 * padded_total);
        });
    }
}

// H2: a gradient for a frozen param, or for a param without a (large enough) grad buffer, is an
// error naming the ds_id, and no collective is issued for it.
TEST(FrozenRefusal, GradientForFrozenOrBufferlessParamThrowsWithoutACollective)
{
    for (int64_t ws : {2, 3}) {
        SCOPED_TRACE("world_size " + std::to_string(ws));
        auto world = std::make_shared<LoopbackWorld>(ws);
        Barrier barrier(ws);
        runRanks(world, smallConfig(), [&](int64_t rank, Runtime& rt) {
            registerZ3(rt, 5011, {5}, /*frozen=*/true);
            // Registered without a buffer (frozen), then unfrozen from Python.
            const at::Tensor shard = shardOf(fullParam(5012, {7}), ShardLayout::of(7, ws), rank);
            rt.registerZ3Param(5012, {7}, shard, emptyF(0), false, std::nullopt);
            rt.setParamFrozen(5012, false);
            at::Tensor ok_buf = registerZ3(rt, 5013, {3, 3});
            // Has a buffer, frozen from Python: the flag alone must stop it.
            at::Tensor frozen_buf = registerZ3(rt, 5014, {4});
            rt.setParamFrozen(5014, true);
            rt.registerGraph(kGraph, {5011, 5012, 5013, 5014}, ZeroStage::Z3);

            rt.startBackward(true);
            rt.reduceGrad(kGraph, 5013, rankGrad(5013, {3, 3}, rank, 0));  // queued, not sent
            barrier.wait();
            const int64_t before = world->issued();
            EXPECT_TRUE(throwsNaming(
                [&] { rt.reduceGrad(kGraph, 5011, rankGrad(5011, {5}, rank, 0)); },
                {"reduce_grad", "5011", "frozen"}));
            EXPECT_TRUE(throwsNaming(
                [&] { rt.reduceGrad(kGraph, 5012, rankGrad(5012, {7}, rank, 0)); },
                {"reduce_grad", "5012", "grad buffer"}));
            EXPECT_TRUE(throwsNaming(
                [&] { rt.reduceGrad(kGraph, 5014, rankGrad(5014, {4}, rank, 0)); },
                {"reduce_grad", "5014", "frozen"}));
            EXPECT_EQ(rt.pendingGradients(), 1u);  // only the trainable one
            barrier.wait();
            EXPECT_EQ(world->issued(), before);
            EXPECT_EQ(rt.stats().reduce_scatter_calls, 0);
            barrier.wait();

            // The trainable param of the same pass is unaffected.
            rt.endBackward(kGraph, true);
            expectShard(ok_buf, expectedShard(5013, {3, 3}, ws, rank, {0}), 5013);
            EXPECT_EQ(rt.stats().reduce_scatter_calls, 1);
            EXPECT_FALSE(rt.paramState(5011).grad_accumulated);
            EXPECT_FALSE(rt.paramState(5012).grad_accumulated);
            EXPECT_FALSE(rt.paramState(5014).grad_accumulated);
            EXPECT_TRUE(frozen_buf.eq(0.0f).all().item<bool>());
        });
        EXPECT_EQ(world->issued(), ws);
    }
}

// The flag is checked again where the bucket is flushed: a param frozen after its gradient was
// queued is refused there, before any collective of that flush.
TEST(FrozenRefusal, FreezingAParamWithAQueuedGradientIsRefused)
{
    const int64_t ws = 3;
    auto world = std::make_shared<LoopbackWorld>(ws);
    Barrier barrier(ws);
    runRanks(world, smallConfig(), [&](int64_t rank, Runtime& rt) {
        at::Tensor a_buf = registerZ3(rt, 6021, {5});
        at::Tensor b_buf = registerZ3(rt, 6022, {4});
        rt.registerGraph(kGraph, {6021, 6022}, ZeroStage::Z3);
        rt.startBackward(true);
        rt.reduceGrad(kGraph, 6021, rankGrad(6021, {5}, rank, 0));
        rt.reduceGrad(kGraph, 6022, rankGrad(6022, {4}, rank, 0));
        barrier.wait();
        const int64_t before = world->issued();
        // The flush would have to drop it: refused where the state would change.
        EXPECT_TRUE(throwsNaming([&] { rt.setParamFrozen(6022, true); },
                                 {"set_param_frozen", "ds_id 6022", "queued"}));
        EXPECT_TRUE(throwsNaming([&] { rt.updateParamGradBuffer(6022, emptyF(0), 0); },
                                 {"update_param_grad_buffer", "ds_id 6022", "queued"}));
        EXPECT_FALSE(rt.isParamFrozen(6022));
        barrier.wait();
        EXPECT_EQ(world->issued(), before);
        EXPECT_EQ(rt.pendingGradients(), 2u);
        barrier.wait();
        rt.endBackward(kGraph, true);
        expectShard(a_buf, expectedShard(6021, {5}, ws, rank, {0}), 6021);
        expectShard(b_buf, expectedShard(6022, {4}, ws, rank, {0}), 6022);
    });
}

TEST(FrozenRefusal, AFlushThatFindsAFrozenParamReducesTheOthersAndNamesIt)
{
    // Below the runtime (which refuses freezing a param with a queued gradient): the flush's
    // own check, on one rank.
    auto world = std::make_shared<LoopbackWorld>(1);
    std::unique_ptr<Collectives> comm = makeLoopbackCollectives(world, 0);
    std::unique_ptr<DeviceBackend> device = makeHostDevice();
    CommStats stats;
    ParamRegistry registry;
    for (int64_t id : {7001, 7002, 7003}) {
        ParamEntry e;
        e.ds_id = id;
        e.shape = {4};
        e.numel = 4;
        e.layout = ShardLayout::of(4, 1);
        e.shard = zerosF(4);
        e.grad_buffer = zerosF(4);
        registry.put(std::move(e));
    }
    GradReducer reducer(registry, *comm, *device, stats, 1 << 10, false);
    const std::vector<at::Tensor> grads = {rankGrad(7001, {4}, 0, 0), rankGrad(7002, {4}, 0, 0),
                                           rankGrad(7003, {4}, 0, 0)};
    for (int i = 0; i < 3; ++i) {
        reducer.add(registry.get(7001 + i, "test"), grads[i], "reduce_grad");
    }
    registry.get(7002, "test").frozen = true;
    EXPECT_TRUE(throwsNaming([&] { reducer.flushAll(); },
                             {"bucket flush", "ds_id 7002", "frozen", "other 2 gradients"}));
    EXPECT_EQ(reducer.pending(), 0u);
    EXPECT_TRUE(registry.get(7001, "test").grad_buffer.equal(grads[0]));
    EXPECT_TRUE(registry.get(7003, "test").grad_buffer.equal(grads[2]));
    EXPECT_TRUE(registry.get(7002, "test").grad_buffer.equal(zerosF(4)));
    EXPECT_EQ(stats.reduce_scatter_calls, 2);
}

// H7: an optimizer step invalidates trainable gathered params; a frozen persistent one never
// changes and is gathered exactly once.
TEST(Persistent, FrozenIsGatheredOnceTrainableAfterEveryStep)
{
    const int64_t ws = 3;
    runRanks(ws, smallConfig(), [&](int64_t rank, Runtime& rt) {
        registerZ3(rt, 21, {5}, /*frozen=*/true);
        at::Tensor buf = registerZ3(rt, 22, {7});
        rt.registerGraph(kGraph, {21, 22}, ZeroStage::Z3);
        rt.setPersistent(21);
        rt.setPersistent(22);
        EXPECT_EQ(rt.stats().allgather_calls, 2);
        for (int64_t step = 0; step < 3; ++step) {
            SCOPED_TRACE("step " + std::to_string(step));
            rt.startBackward(true);
            int64_t calls = rt.stats().allgather_calls;
            at::Tensor frozen = rt.allgatherParam(kGraph, 21, std::nullopt);
            EXPECT_EQ(rt.stats().allgather_calls, calls);  // never again
            EXPECT_TRUE(frozen.equal(fullParam(21, {5})));
            at::Tensor trainable = rt.allgatherParam(kGraph, 22, std::nullopt);
            // Valid from set_persistent before the first step, re-gathered after each step.
            EXPECT_EQ(rt.stats().allgather_calls, calls + (step == 0 ? 0 : 1));
            EXPECT_TRUE(trainable.equal(fullParam(22, {7})));
            rt.releaseParam(kGraph, 21, 1);
            rt.releaseParam(kGraph, 22, 1);
            EXPECT_TRUE(rt.paramState(21).valid);
            rt.reduceGrad(kGraph, 22, rankGrad(22, {7}, rank, step));
            rt.endBackward(kGraph, false);
            EXPECT_TRUE(rt.paramState(21).valid);
            EXPECT_FALSE(rt.paramState(22).valid);
            expectShard(buf, expectedShard(22, {7}, ws, rank, {step}), 22);
        }
        EXPECT_EQ(rt.stats().allgather_calls, 2 + 2);
    });
}

TEST(Profiling, ReduceGradIsANoOpWhileProfiling)
{
    const int64_t ws = 2;
    auto world = std::make_shared<LoopbackWorld>(ws);
    Barrier barrier(ws);
    runRanks(world, smallConfig(), [&](int64_t rank, Runtime& rt) {
        at::Tensor buf = registerZ3(rt, 31, {5});
        rt.registerGraph(kGraph, {31}, ZeroStage::Z3);
        rt.enableProfiling(true);
        rt.startBackward(true);
        rt.reduceGrad(kGraph, 31, rankGrad(31, {5}, rank, 0));
        EXPECT_EQ(rt.pendingGradients(), 0u);
        rt.endBackward(kGraph, true);
        barrier.wait();
        EXPECT_EQ(world->issued(), 0);
        EXPECT_TRUE(buf.eq(0.0f).all().item<bool>());
        EXPECT_FALSE(rt.paramState(31).grad_accumulated);
        barrier.wait();

        rt.enableProfiling(false);
        rt.startBackward(true);
        rt.reduceGrad(kGraph, 31, rankGrad(31, {5}, rank, 1));
        rt.endBackward(kGraph, true);
        expectShard(buf, expectedShard(31, {5}, ws, rank, {1}), 31);
    });
    EXPECT_EQ(world->issued(), ws);
}

// end_backward before the first start_backward: DeepCompile's profiler may run a backward graph
// then (profiling on, nothing queued); anything else is refused before any state changes.
TEST(BackwardOrder, EndBackwardBeforeTheFirstStartBackward)
{
    const int64_t ws = 2;
    auto world = std::make_shared<LoopbackWorld>(ws);
    runRanks(world, smallConfig(), [&](int64_t rank, Runtime& rt) {
        at::Tensor buf = registerZ3(rt, 41, {5});
        rt.registerGraph(kGraph, {41}, ZeroStage::Z3);
        rt.enableProfiling(true);
        rt.endBackward(kGraph, true);
        rt.enableProfiling(false);
        rt.reduceGrad(kGraph, 41, rankGrad(41, {5}, rank, 0));
        for (bool profiling : {false, true}) {
            rt.enableProfiling(profiling);
            EXPECT_TRUE(throwsNaming([&] { rt.endBackward(kGraph, true); },
                                     {"end_backward", "graph_id " + std::to_string(kGraph),
                                      "no backward has begun", "1 gradients queued"}));
            EXPECT_EQ(rt.pendingGradients(), 1u);
        }
        rt.enableProfiling(false);
        EXPECT_TRUE(buf.eq(0.0f).all().item<bool>());
        rt.startBackward(true);
        rt.endBackward(kGraph, true);
        expectShard(buf, expectedShard(41, {5}, ws, rank, {0}), 41);
    });
    EXPECT_EQ(world->issued(), ws);
}

// Gradients are bucketed per dtype: expected_grad_dtype converts them first; a buffer of another
// dtype than the gradient receives through a staging copy.
TEST(Buckets, MixedDtypesReduceIntoTheirBuffers)
{
    const int64_t ws = 3;
    runRanks(ws, smallConfig(), [&](int64_t rank, Runtime& rt) {
        auto shard = [&](int64_t id, int64_t n) {
            return shardOf(fullParam(id, {n}), ShardLayout::of(n, ws), rank);
        };
        at::Tensor f_buf = zerosF(2);
        at::Tensor d_buf = at::zeros({3}, at::kDouble);
        at::Tensor staged_buf = at::zeros({2}, at::kDouble);
        rt.registerZ3Param(71, {5}, shard(71, 5), f_buf, false, std::nullopt);
        rt.registerZ3Param(72, {7}, shard(72, 7), d_buf, false, at::kDouble);
        rt.registerZ3Param(73, {4}, shard(73, 4), staged_buf, false, std::nullopt);
        rt.registerGraph(kGraph, {71, 72, 73}, ZeroStage::Z3);
        for (int64_t step = 0; step < 2; ++step) {
            rt.startBackward(step == 1);
            rt.reduceGrad(kGraph, 71, rankGrad(71, {5}, rank, step));
            rt.reduceGrad(kGraph, 72, rankGrad(72, {7}, rank, step));
            rt.reduceGrad(kGraph, 73, rankGrad(73, {4}, rank, step));
            rt.endBackward(kGraph, true);
        }
        EXPECT_EQ(d_buf.scalar_type(), at::kDouble);
        expectShard(f_buf, expectedShard(71, {5}, ws, rank, {0, 1}), 71);
        expectShard(d_buf.to(at::kFloat), expectedShard(72, {7}, ws, rank, {0, 1}), 72);
        expectShard(staged_buf.to(at::kFloat), expectedShard(73, {4}, ws, rank, {0, 1}), 73);
        EXPECT_EQ(rt.stats().reduce_scatter_calls, 6);
        // 72's gradients travel as double (padded 9 elements), the others as float (padded 6).
        EXPECT_EQ(rt.stats().reduce_scatter_bytes, 2 * (6 * 4 + 9 * 8 + 6 * 4));
    });
}

// H3 at reduce time: a gradient that does not match its param is refused, naming the id.
TEST(FrozenRefusal, GradientOfTheWrongSizeOrDtypeIsRefused)
{
    auto world = std::make_shared<LoopbackWorld>(1);
    runRanks(world, smallConfig(), [&](int64_t, Runtime& rt) {
        registerZ3(rt, 9091, {5});
        rt.registerGraph(kGraph, {9091}, ZeroStage::Z3);
        rt.startBackward(true);
        EXPECT_TRUE(throwsNaming([&] { rt.reduceGrad(kGraph, 9091, zerosF(4)); },
                                 {"reduce_grad", "9091", "4"}));
        EXPECT_TRUE(throwsNaming([&] { rt.reduceGrad(kGraph, 9091, at::zeros({5}, at::kLong)); },
                                 {"reduce_grad", "9091"}));
        EXPECT_TRUE(throwsNaming([&] { rt.reduceGrad(kGraph, 9091, at::Tensor()); },
                                 {"reduce_grad", "9091"}));
        EXPECT_EQ(rt.pendingGradients(), 0u);
        rt.endBackward(kGraph, true);
    });
    EXPECT_EQ(world->issued(), 0);
}

// ZeRO-1/2: the full gradient is all-reduced and this rank's partition [offset, offset + n)
// copied into its grad buffer. ZeRO-2 reduces every pass, ZeRO-1 once per window (local sum).
struct Partitioned {
    at::Tensor buf;
    int64_t offset;
};

Partitioned registerZ12(Runtime& rt, int64_t ds_id, const std::vector<int64_t>& shape)
{
    const int64_t n = numelOf(shape);
    const ShardLayout l = ShardLayout::of(n, rt.worldSize());
    const int64_t offset = std::min(l.shardBegin(rt.rank()), n);
    at::Tensor buf = zerosF(l.validInShard(rt.rank()));  // may be empty on trailing ranks
    rt.registerParam(ds_id, shape, fullParam(ds_id, shape), buf, offset);
    return {buf, offset};
}

at::Tensor expectedPartition(int64_t ds_id, const std::vector<int64_t>& shape, int64_t ws,
                             const Partitioned& p, const std::vector<int64_t>& steps)
{
    at::Tensor sum = zerosF(numelOf(shape));
    for (int64_t s : steps) { sum.add_(meanGrad(ds_id, shape, ws, s)); }
    return sum.narrow(0, p.offset, p.buf.numel());
}

// registerZ12 of shapes[i] as ds_id first_id + i, for every i.
std::vector<Partitioned> registerZ12All(Runtime& rt,
                                        const std::vector<std::vector<int64_t>>& shapes,
                                        int64_t first_id)
{
    std::vector<Partitioned> parts;
    for (size_t i = 0; i < shapes.size(); ++i) {
        parts.push_back(registerZ12(rt, first_id + static_cast<int64_t>(i), shapes[i]));
    }
    return parts;
}

// Every partition registered by registerZ12All holds its part of the mean gradients of `steps`.
void expectPartitions(const std::vector<Partitioned>& parts,
                      const std::vector<std::vector<int64_t>>& shapes, int64_t first_id,
                      int64_t ws, const std::vector<int64_t>& steps)
{
    for (size_t i = 0; i < shapes.size(); ++i) {
        const int64_t id = first_id + static_cast<int64_t>(i);
        SCOPED_TRACE("ds_id " + std::to_string(id));
        EXPECT_TRUE(parts[i].buf.allclose(expectedPartition(id, shapes[i], ws, parts[i], steps),
                                          1e-6, 1e-5))
            << parts[i].buf;
    }
}

TEST(Zero12, Zero2ReducesEveryPassIntoThePartition)
{
    for (int64_t ws : {1, 2, 3}) {
        SCOPED_TRACE("world_size " + std::to_string(ws));
        runRanks(ws, smallConfig(16), [&](int64_t rank, Runtime& rt) {
            const std::vector<std::vector<int64_t>> shapes = {{5}, {3, 3}, {2}, {17}};
            const std::vector<Partitioned> parts = registerZ12All(rt, shapes, 40);
            // A frozen param the optimizer never registered may be listed.
            rt.registerGraph(kGraph, {40, 41, 42, 43, 999}, ZeroStage::Z2);
            for (int64_t step = 0; step < 2; ++step) {
                rt.startBackward(step == 1);
                for (size_t i = 0; i < shapes.size(); ++i) {
                    const int64_t id = 40 + static_cast<int64_t>(i);
                    rt.reduceGrad(kGraph, id, rankGrad(id, shapes[i], rank, step));
                }
                rt.endBackward(kGraph, true);
            }
            expectPartitions(parts, shapes, 40, ws, {0, 1});
            EXPECT_EQ(rt.stats().allreduce_calls, 2 * static_cast<int64_t>(shapes.size()));
            EXPECT_EQ(rt.stats().reduce_scatter_calls, 0);
        });
    }
}

// One rank sums over itself: its gradients land in the grad buffers (ZeRO-3 shards with
// accumulation, ZeRO-2 partitions) without a single collective, and the counters still count
// one reduction per gradient. Several flushes per pass (capacity 8) and both bucket modes.
TEST(OneRank, GradientsLandWithoutACollective)
{
    for (bool double_buffer : {false, true}) {
        SCOPED_TRACE(std::string("double_buffer ") + (double_buffer ? "on" : "off"));
        auto world = std::make_shared<LoopbackWorld>(1);
        runRanks(world, smallConfig(8, double_buffer), [&](int64_t rank, Runtime& rt) {
            const GraphParams p = registerGraphOf(rt, kShapes);
            backwardPass(rt, p, rank, 0, /*boundary=*/false, /*release_reduce_buckets=*/false);
            backwardPass(rt, p, rank, 1, /*boundary=*/true, /*release_reduce_buckets=*/true);
            expectShards(p, 1, rank, {0, 1}, /*padding_zero=*/true);
            EXPECT_EQ(rt.stats().reduce_scatter_calls, 2 * static_cast<int64_t>(p.ids.size()));
            EXPECT_GT(rt.stats().bucket_flushes, 2);

            const std::vector<std::vector<int64_t>> shapes = {{5}, {3, 3}, {2}};
            const std::vector<Partitioned> parts = registerZ12All(rt, shapes, 40);
            rt.registerGraph(kGraph + 1, {40, 41, 42}, ZeroStage::Z2);
            rt.startBackward(true);
            for (size_t i = 0; i < shapes.size(); ++i) {
                const int64_t id = 40 + static_cast<int64_t>(i);
                rt.reduceGrad(kGraph + 1, id, rankGrad(id, shapes[i], rank, 0));
            }
            rt.endBackward(kGraph + 1, true);
            expectPartitions(parts, shapes, 40, 1, {0});
            EXPECT_EQ(rt.stats().allreduce_calls, static_cast<int64_t>(shapes.size()));
        });
        EXPECT_EQ(world->issued(), 0);
    }
}

TEST(Zero12, Zero1ReducesTheLocalSumOncePerWindow)
{
    for (int64_t ws : {2, 3}) {
        SCOPED_TRACE("world_size " + std::to_string(ws));
        runRanks(ws, smallConfig(16), [&](int64_t rank, Runtime& rt) {
            const std::vector<std::vector<int64_t>> shapes = {{7}, {2, 5}, {1}};
            const std::vector<Partitioned> parts = registerZ12All(rt, shapes, 50);
            rt.registerGraph(kGraph, {50, 51, 52}, ZeroStage::Z1);
            std::vector<at::Tensor> grads;
            for (int64_t step = 0; step < 2; ++step) {
                rt.startBackward(step == 1);
                for (size_t i = 0; i < shapes.size(); ++i) {
                    const int64_t id = 50 + static_cast<int64_t>(i);
                    grads.push_back(rankGrad(id, shapes[i], rank, step));
                    rt.reduceGrad(kGraph, id, grads.back());
                }
                rt.endBackward(kGraph, true);
                if (step == 0) {
                    // Nothing reduced before the boundary.
                    EXPECT_EQ(rt.stats().allreduce_calls, 0);
                    for (const auto& p : parts) { EXPECT_TRUE(p.buf.eq(0.0f).all().item<bool>()); }
                }
            }
            expectPartitions(parts, shapes, 50, ws, {0, 1});
            EXPECT_EQ(rt.stats().allreduce_calls, static_cast<int64_t>(shapes.size()));
            // The local sums never wrote into the callers' gradients.
            for (size_t k = 0; k < grads.size(); ++k) {
                const size_t i = k % shapes.size();
                const int64_t step = static_cast<int64_t>(k / shapes.size());
                EXPECT_TRUE(grads[k].equal(
                    rankGrad(50 + static_cast<int64_t>(i), shapes[i], rank, step)));
            }
        });
    }
}

}  // namespace
}  // namespace dsz::test
