// ZeRO-3 gathering end to end on simulated ranks: allgather, prefetch, release (use counts and
// freeing), persistence and the profiler's invalidation functions.
#include "harness.h"

namespace dsz::test {
namespace {

constexpr int64_t kGraph = 100;

// Odd sizes on purpose: most are not divisible by 2, 3 or 5.
const std::vector<std::vector<int64_t>> kShapes = {{5}, {3, 7}, {1}, {2, 2, 3}, {1025}};

bool freed(const at::Tensor& t) { return t.storage().nbytes() == 0; }

// Registers a ZeRO-3 param per entry of kShapes (ds_ids 1, 2, ...) and kGraph over them all.
std::vector<int64_t> registerShapesGraph(Runtime& rt)
{
    const auto ids = idsFor(kShapes.size());
    for (size_t i = 0; i < ids.size(); ++i) { registerZ3(rt, ids[i], kShapes[i]); }
    rt.registerGraph(kGraph, ids, ZeroStage::Z3);
    return ids;
}

class GatherAtWorldSize : public ::testing::TestWithParam<int64_t> {};

TEST_P(GatherAtWorldSize, AllgatherReturnsTheExactFullTensorOnEveryRank)
{
    const int64_t ws = GetParam();
    auto world = std::make_shared<LoopbackWorld>(ws);
    runRanks(world, smallConfig(), [&](int64_t, Runtime& rt) {
        const auto ids = registerShapesGraph(rt);
        for (size_t i = 0; i < ids.size(); ++i) {
            SCOPED_TRACE("ds_id " + std::to_string(ids[i]));
            at::Tensor full = rt.allgatherParam(kGraph, ids[i], std::nullopt);
            rt.waitAllgather(kGraph, ids[i]);
            EXPECT_EQ(full.sizes().vec(), kShapes[i]);
            EXPECT_EQ(full.scalar_type(), at::kFloat);
            EXPECT_TRUE(full.equal(fullParam(ids[i], kShapes[i])));
            EXPECT_TRUE(rt.paramState(ids[i]).gathered);
            // The valid copy again, converted: no new collective.
            at::Tensor as_double = rt.allgatherParam(kGraph, ids[i], at::kDouble);
            EXPECT_EQ(as_double.scalar_type(), at::kDouble);
            EXPECT_TRUE(as_double.equal(fullParam(ids[i], kShapes[i]).to(at::kDouble)));
            rt.releaseParam(kGraph, ids[i], 1);
            // On one rank the gathered param is the shard itself (OneRank below): nothing to free.
            EXPECT_EQ(freed(full), ws > 1);
            EXPECT_FALSE(rt.paramState(ids[i]).gathered);
        }
        // A requested dtype converts the gathered values.
        at::Tensor d = rt.allgatherParam(kGraph, ids[1], at::kDouble);
        EXPECT_EQ(d.scalar_type(), at::kDouble);
        EXPECT_TRUE(d.equal(fullParam(ids[1], kShapes[1]).to(at::kDouble)));
        rt.releaseParam(kGraph, ids[1], 1);

        const CommStats s = rt.stats();
        EXPECT_EQ(s.allgather_calls, static_cast<int64_t>(ids.size()) + 1);
        EXPECT_EQ(s.reduce_scatter_calls, 0);
    });
    // Every rank joined every gather; one rank needs a collective only for the double copy.
    EXPECT_EQ(world->issued(), ws > 1 ? ws * static_cast<int64_t>(kShapes.size() + 1) : 1);
}

TEST_P(GatherAtWorldSize, PrefetchThenAllgatherWaitRelease)
{
    const int64_t ws = GetParam();
    auto world = std::make_shared<LoopbackWorld>(ws);
    runRanks(world, smallConfig(), [&](int64_t, Runtime& rt) {
        const auto ids = registerShapesGraph(rt);

        rt.prefetchParamsFused(kGraph, ids, std::nullopt);
        EXPECT_EQ(rt.stats().allgather_calls, static_cast<int64_t>(ids.size()));
        // Gathered already: allgather_param issues nothing more.
        for (size_t i = 0; i < ids.size(); ++i) {
            at::Tensor full = rt.allgatherParam(kGraph, ids[i], std::nullopt);
            rt.waitAllgather(kGraph, ids[i]);
            EXPECT_TRUE(full.equal(fullParam(ids[i], kShapes[i])));
        }
        EXPECT_EQ(rt.stats().allgather_calls, static_cast<int64_t>(ids.size()));
        // A second prefetch of valid copies is a no-op too.
        rt.prefetchParamsFused(kGraph, ids, std::nullopt);
        EXPECT_EQ(rt.stats().allgather_calls, static_cast<int64_t>(ids.size()));

        for (int64_t id : ids) { rt.releaseParam(kGraph, id, 1); }
        // Released copies are gathered again, prefetched with a dtype this time.
        rt.prefetchParamsFused(kGraph, {ids[0], ids[4]},
                               std::vector<at::ScalarType>{at::kDouble, at::kFloat});
        EXPECT_EQ(rt.stats().allgather_calls, static_cast<int64_t>(ids.size()) + 2);
        at::Tensor a = rt.allgatherParam(kGraph, ids[0], at::kDouble);
        at::Tensor b = rt.allgatherParam(kGraph, ids[4], std::nullopt);
        EXPECT_EQ(a.scalar_type(), at::kDouble);
        EXPECT_TRUE(a.equal(fullParam(ids[0], kShapes[0]).to(at::kDouble)));
        EXPECT_TRUE(b.equal(fullParam(ids[4], kShapes[4])));
        rt.releaseParam(kGraph, ids[0], 1);
        rt.releaseParam(kGraph, ids[4], 1);
        EXPECT_TRUE(freed(a));  // a double copy of a float shard, at every world size
        EXPECT_EQ(freed(b), ws > 1);
    });
    EXPECT_EQ(world->issued(), ws > 1 ? ws * static_cast<int64_t>(kShapes.size() + 2) : 1);
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, GatherAtWorldSize, ::testing::Values(1, 2, 3, 5),
                         [](const auto& info) { return "ws" + std::to_string(info.param); });

// One rank: a gather in the shard's dtype hands out the shard itself. No collective, no copy, and
// a release that forgets it without freeing the shard. Any other dtype is a real copy, freed as
// at every world size.
TEST(OneRank, TheGatheredParamIsTheShard)
{
    auto world = std::make_shared<LoopbackWorld>(1);
    runRanks(world, smallConfig(), [&](int64_t, Runtime& rt) {
        const std::vector<int64_t> shape = {3, 7};
        const at::Tensor expected = fullParam(51, shape);
        at::Tensor shard = expected.reshape(-1).clone();
        rt.registerZ3Param(51, shape, shard, zerosF(21), false, std::nullopt);
        registerZ3(rt, 52, {5}, /*frozen=*/true);
        rt.registerGraph(kGraph, {51, 52}, ZeroStage::Z3);

        at::Tensor full = rt.allgatherParam(kGraph, 51, std::nullopt);
        rt.waitAllgather(kGraph, 51);
        EXPECT_EQ(full.sizes().vec(), shape);
        EXPECT_EQ(full.data_ptr(), shard.data_ptr());
        EXPECT_TRUE(full.equal(expected));
        rt.releaseParam(kGraph, 51, 1);
        EXPECT_FALSE(rt.paramState(51).gathered);
        EXPECT_FALSE(freed(shard));
        EXPECT_TRUE(shard.equal(expected.reshape(-1)));

        // The optimizer writes the shard in place; the next gather shows the new values.
        shard.add_(1.0f);
        at::Tensor after = rt.allgatherParam(kGraph, 51, std::nullopt);
        EXPECT_TRUE(after.equal(expected.add(1.0)));
        rt.releaseParam(kGraph, 51, 1);

        // Prefetched: the same, for both params.
        rt.prefetchParamsFused(kGraph, {51, 52}, std::nullopt);
        EXPECT_TRUE(rt.paramState(51).gathered && rt.paramState(52).gathered);
        at::Tensor f = rt.allgatherParam(kGraph, 51, std::nullopt);
        EXPECT_EQ(f.data_ptr(), shard.data_ptr());
        rt.releaseParam(kGraph, 51, 1);
        rt.releaseParam(kGraph, 52, 1);
        EXPECT_FALSE(freed(shard));

        // Another dtype is a copy: it leaves the shard alone and its release frees the copy.
        at::Tensor d = rt.allgatherParam(kGraph, 51, at::kDouble);
        EXPECT_NE(d.data_ptr(), shard.data_ptr());
        EXPECT_TRUE(d.equal((expected.add(1.0)).to(at::kDouble)));
        rt.releaseParam(kGraph, 51, 1);
        EXPECT_TRUE(freed(d));
        EXPECT_FALSE(freed(shard));

        // A gather after an optimizer step (the shard's view still held, no longer valid) in
        // another dtype is a copy like any other: its release frees it, not the shard.
        rt.allgatherParam(kGraph, 51, std::nullopt);
        rt.startBackward(true);
        rt.endBackward(kGraph, false);
        EXPECT_FALSE(rt.paramState(51).valid);
        at::Tensor d2 = rt.allgatherParam(kGraph, 51, at::kDouble);
        rt.releaseParam(kGraph, 51, 1);
        EXPECT_TRUE(freed(d2));
        EXPECT_FALSE(freed(shard));

        // A kept copy that is the shard costs nothing against the persistence budget.
        rt.setPersistenceBudget(0);
        rt.setPersistent(52);
        EXPECT_TRUE(rt.paramState(52).persistent);
        EXPECT_EQ(rt.persistenceUse().selected_bytes, 0);

        // Counted as the gathers they stand for: 51 six times, 52 twice.
        EXPECT_EQ(rt.stats().allgather_calls, 8);
    });
    EXPECT_EQ(world->issued(), 2);  // the double copies only
}

TEST(Release, FreesAtTheLastUserAndASecondReleaseErrors)
{
    runRanks(2, smallConfig(), [&](int64_t, Runtime& rt) {
        registerZ3(rt, 7301, {3, 3});
        rt.registerGraph(kGraph, {7301}, ZeroStage::Z3);
        at::Tensor full = rt.allgatherParam(kGraph, 7301, std::nullopt);
        const at::Tensor expected = fullParam(7301, {3, 3});
        rt.releaseParam(kGraph, 7301, 3);
        rt.releaseParam(kGraph, 7301, 3);
        // Two of three users done: still there and intact.
        EXPECT_FALSE(freed(full));
        EXPECT_TRUE(full.equal(expected));
        rt.releaseParam(kGraph, 7301, 3);
        EXPECT_TRUE(freed(full));
        // Nothing is gathered any more: another release is a caller error, not a silent no-op.
        EXPECT_TRUE(throwsNaming([&] { rt.releaseParam(kGraph, 7301, 1); },
                                 {"release_param", "7301"}));
        // The param is still usable.
        at::Tensor again = rt.allgatherParam(kGraph, 7301, std::nullopt);
        EXPECT_TRUE(again.equal(expected));
        EXPECT_EQ(rt.stats().allgather_calls, 2);
    });
}

TEST(Persistent, StaysGatheredAcrossReleases)
{
    auto world = std::make_shared<LoopbackWorld>(3);
    runRanks(world, smallConfig(), [&](int64_t, Runtime& rt) {
        registerZ3(rt, 61, {7}, /*frozen=*/false, /*persistent=*/true);
        registerZ3(rt, 62, {4});
        rt.setPersistent(62);  // gathers right away
        EXPECT_EQ(rt.stats().allgather_calls, 1);
        EXPECT_TRUE(rt.paramState(62).persistent);
        EXPECT_TRUE(rt.paramState(62).gathered);
        rt.registerGraph(kGraph, {61, 62}, ZeroStage::Z3);
        for (int round = 0; round < 3; ++round) {
            at::Tensor a = rt.allgatherParam(kGraph, 61, std::nullopt);
            at::Tensor b = rt.allgatherParam(kGraph, 62, std::nullopt);
            EXPECT_TRUE(a.equal(fullParam(61, {7})));
            EXPECT_TRUE(b.equal(fullParam(62, {4})));
            rt.releaseParam(kGraph, 61, 1);
            rt.releaseParam(kGraph, 62, 1);
            EXPECT_FALSE(freed(a));
            EXPECT_FALSE(freed(b));
        }
        // 62 once in set_persistent, 61 once at its first use.
        EXPECT_EQ(rt.stats().allgather_calls, 2);
        // The profiler's invalidation leaves persistent copies alone.
        rt.invalidateGatheredParam(61);
        rt.clearAllGatheredParams();
        EXPECT_TRUE(rt.allgatherParam(kGraph, 61, std::nullopt).equal(fullParam(61, {7})));
        EXPECT_EQ(rt.stats().allgather_calls, 2);
    });
    EXPECT_EQ(world->issued(), 3 * 2);
}

TEST(Profiling, InvalidateAndClearThenReleaseWork)
{
    runRanks(2, smallConfig(), [&](int64_t, Runtime& rt) {
        registerZ3(rt, 81, {5});
        registerZ3(rt, 82, {3, 3});
        rt.registerGraph(kGraph, {81, 82}, ZeroStage::Z3);
        EXPECT_FALSE(rt.isProfiling());
        rt.enableProfiling(true);
        EXPECT_TRUE(rt.isProfiling());

        // The profiler gathers, then invalidates right away and keeps the tensor itself.
        at::Tensor a = rt.allgatherParam(kGraph, 81, std::nullopt);
        rt.invalidateGatheredParam(81);
        EXPECT_FALSE(rt.paramState(81).gathered);
        EXPECT_FALSE(rt.paramState(81).valid);
        // Its release later in the graph must work and must not free the profiler's tensor.
        rt.releaseParam(kGraph, 81, 1);
        EXPECT_FALSE(freed(a));
        EXPECT_TRUE(a.equal(fullParam(81, {5})));

        // A gathered, unreleased copy is dropped by clear_all_gathered_params.
        at::Tensor b = rt.allgatherParam(kGraph, 82, std::nullopt);
        rt.clearAllGatheredParams();
        EXPECT_FALSE(rt.paramState(82).gathered);
        EXPECT_FALSE(freed(b));
        rt.enableProfiling(false);
        EXPECT_EQ(rt.stats().allgather_calls, 2);

        // The real run gathers both afresh and frees them at their last use.
        at::Tensor a2 = rt.allgatherParam(kGraph, 81, std::nullopt);
        at::Tensor b2 = rt.allgatherParam(kGraph, 82, std::nullopt);
        EXPECT_EQ(rt.stats().allgather_calls, 4);
        EXPECT_TRUE(a2.equal(fullParam(81, {5})));
        EXPECT_TRUE(b2.equal(fullParam(82, {3, 3})));
        rt.releaseParam(kGraph, 81, 1);
        rt.releaseParam(kGraph, 82, 1);
        EXPECT_TRUE(freed(a2));
        EXPECT_TRUE(freed(b2));
    });
}

TEST(Profiling, ClearEndsTheUseCountOfAProfiledRunThatStoppedMidway)
{
    runRanks(2, smallConfig(), [&](int64_t, Runtime& rt) {
        registerZ3(rt, 83, {4});
        rt.registerGraph(kGraph, {83}, ZeroStage::Z3);
        // The profiler's run: gathered, its first of two users released, then the run stops (an
        // error in a later node) and the profiler clears what was gathered.
        rt.enableProfiling(true);
        at::Tensor profiled = rt.allgatherParam(kGraph, 83, std::nullopt);
        rt.invalidateGatheredParam(83);
        rt.releaseParam(kGraph, 83, 2);
        rt.clearAllGatheredParams();
        rt.enableProfiling(false);

        // The real run: the copy lives until its second user is done.
        at::Tensor a = rt.allgatherParam(kGraph, 83, std::nullopt);
        rt.releaseParam(kGraph, 83, 2);
        EXPECT_FALSE(freed(a));
        EXPECT_TRUE(a.equal(fullParam(83, {4})));
        rt.releaseParam(kGraph, 83, 2);
        EXPECT_TRUE(freed(a));
        EXPECT_FALSE(rt.paramState(83).gathered);
    });
}

TEST(FreeTensors, FreesLargeTensorsExceptWhileProfiling)
{
    RuntimeConfig config = smallConfig();
    config.free_activation_threshold = 4;
    runRanks(1, config, [&](int64_t, Runtime& rt) {
        at::Tensor big = zerosF(10);
        at::Tensor small = zerosF(4);
        rt.enableProfiling(true);
        rt.freeTensors({big, small});
        EXPECT_EQ(big.numel(), 10);
        rt.enableProfiling(false);
        rt.freeTensors({big, small, at::Tensor()});
        EXPECT_EQ(big.numel(), 0);
        EXPECT_EQ(small.numel(), 4);
    });
}

TEST(ActivationOffload, RoundTripOnTheHost)
{
    runRanks(1, smallConfig(), [&](int64_t, Runtime& rt) {
        registerZ3(rt, 1, {3});
        rt.registerGraph(kGraph, {1}, ZeroStage::Z3);
        const at::Tensor act = fullParam(5, {2, 3});
        at::Tensor host = rt.offloadTensor(act, kGraph, 12);
        EXPECT_TRUE(rt.waitOffload(kGraph, 12).equal(act));
        EXPECT_TRUE(host.equal(act));
        rt.reloadTensor(kGraph, 12);
        at::Tensor ready = rt.waitReload(zerosF(1), kGraph, 12);
        EXPECT_TRUE(ready.equal(act));
        EXPECT_EQ(ready.sizes().vec(), (std::vector<int64_t>{2, 3}));
        // Resident parameters need no reload and stay intact.
        rt.reloadParameter(kGraph, 1);
        rt.offloadParameter(kGraph, 1);
        EXPECT_TRUE(rt.allgatherParam(kGraph, 1, std::nullopt).equal(fullParam(1, {3})));
    });
}


TEST(Persistent, SetPersistentStaysWithinTheBudget)
{
    RuntimeConfig config = smallConfig();
    // Room for one gathered 4-element fp32 param (16 bytes), not two.
    config.persistence_budget_bytes = 24;
    runRanks(2, config, [&](int64_t, Runtime& rt) {
        registerZ3(rt, 91, {4});
        registerZ3(rt, 92, {4});
        registerZ3(rt, 93, {3}, /*frozen=*/true, /*persistent=*/true);  // registered: not counted
        rt.setPersistent(91);
        rt.setPersistent(92);  // over the budget: declined, stays a gathered-per-use param
        rt.setPersistent(91);  // already persistent: not counted twice
        EXPECT_TRUE(rt.paramState(91).persistent);
        EXPECT_FALSE(rt.paramState(92).persistent);
        Runtime::PersistenceUse use = rt.persistenceUse();
        EXPECT_EQ(use.selected, 1);
        EXPECT_EQ(use.declined, 1);
        EXPECT_EQ(use.selected_bytes, 4 * 4);
        rt.registerGraph(kGraph, {91, 92}, ZeroStage::Z3);
        at::Tensor a = rt.allgatherParam(kGraph, 92, std::nullopt);
        EXPECT_TRUE(a.equal(fullParam(92, {4})));
        rt.releaseParam(kGraph, 92, 1);
        EXPECT_TRUE(freed(a));
        // Lifting the limit lets the next hint through.
        rt.setPersistenceBudget(std::nullopt);
        rt.setPersistent(92);
        EXPECT_TRUE(rt.paramState(92).persistent);
        EXPECT_TRUE(throwsNaming([&] { rt.setPersistenceBudget(-1); },
                                 {"set_persistence_budget", "-1"}));
    });
}

}  // namespace
}  // namespace dsz::test
