// Registration (frozen flags H1, buffer checks H3, replacement H6) and every unknown-id path of
// the Runtime (H4): each is a c10::Error (RuntimeError in Python) naming the op and the id.
#include <ATen/ops/zeros.h>

#include "harness.h"

namespace dsz::test {
namespace {

std::unique_ptr<Runtime> singleRankRuntime()
{
    return std::make_unique<Runtime>(makeLoopbackCollectives(std::make_shared<LoopbackWorld>(1), 0),
                                     makeHostDevice(), smallConfig());
}

// ---------------------------------------------------------------- registration and frozen flags

TEST(Registration, UndefinedOrEmptyGradBufferMeansFrozen)
{
    runRanks(2, smallConfig(), [&](int64_t rank, Runtime& rt) {
        const ShardLayout l = ShardLayout::of(5, 2);
        const at::Tensor shard = shardOf(fullParam(1, {5}), l, rank);
        rt.registerZ3Param(1, {5}, shard, at::Tensor(), false, std::nullopt);
        rt.registerZ3Param(2, {5}, shard.clone(), emptyF(0), false, std::nullopt);
        rt.registerZ3Param(3, {5}, shard.clone(), emptyF(l.per_rank), false, std::nullopt);
        EXPECT_TRUE(rt.isParamFrozen(1));
        EXPECT_TRUE(rt.isParamFrozen(2));
        EXPECT_FALSE(rt.isParamFrozen(3));
        EXPECT_TRUE(rt.paramState(1).frozen);
        EXPECT_EQ(rt.paramState(1).grad_numel, 0);
        EXPECT_EQ(rt.paramState(3).grad_numel, l.per_rank);
        EXPECT_EQ(rt.paramState(3).shard_numel, l.per_rank);
        EXPECT_EQ(rt.paramState(3).numel, 5);

        // Stated explicitly from Python, both ways.
        rt.setParamFrozen(3, true);
        EXPECT_TRUE(rt.isParamFrozen(3));
        rt.setParamFrozen(3, false);
        EXPECT_FALSE(rt.isParamFrozen(3));
        rt.setParamFrozen(1, false);
        EXPECT_FALSE(rt.isParamFrozen(1));
        rt.setParamFrozen(1, true);
        EXPECT_TRUE(rt.isParamFrozen(1));

        // A frozen param is gathered like any other.
        rt.registerGraph(9, {1, 2, 3}, ZeroStage::Z3);
        EXPECT_TRUE(rt.allgatherParam(9, 1, std::nullopt).equal(fullParam(1, {5})));
        rt.releaseParam(9, 1, 1);
    });
}

// H3: the buffer must hold a whole shard (ceil(numel / world_size)), the shard must be exactly one.
TEST(Registration, GradBufferSmallerThanTheShardOrWrongShardIsRefused)
{
    runRanks(3, smallConfig(), [&](int64_t rank, Runtime& rt) {
        const ShardLayout l = ShardLayout::of(7, 3);  // per_rank 3: floor(7/3) = 2 is too small
        const at::Tensor shard = shardOf(fullParam(8801, {7}), l, rank);
        EXPECT_TRUE(throwsNaming(
            [&] { rt.registerZ3Param(8801, {7}, shard, emptyF(2), false, std::nullopt); },
            {"register_z3_param", "8801", "2"}));
        // Nothing half-registered.
        EXPECT_TRUE(throwsNaming([&] { rt.isParamFrozen(8801); }, {"is_param_frozen", "8801"}));

        EXPECT_TRUE(throwsNaming(
            [&] { rt.registerZ3Param(8802, {7}, emptyF(2), emptyF(3), false, std::nullopt); },
            {"register_z3_param", "8802"}));
        EXPECT_TRUE(throwsNaming(
            [&] { rt.registerZ3Param(8803, {7}, emptyF(7), emptyF(3), false, std::nullopt); },
            {"register_z3_param", "8803"}));
        EXPECT_TRUE(throwsNaming(
            [&] { rt.registerZ3Param(8804, {7}, at::Tensor(), emptyF(3), false, std::nullopt); },
            {"register_z3_param", "8804"}));
        EXPECT_TRUE(throwsNaming(
            [&] {
                rt.registerZ3Param(8805, {7}, shard, at::zeros({3}, at::kInt), false, std::nullopt);
            },
            {"register_z3_param", "8805"}));
        EXPECT_TRUE(throwsNaming(
            [&] { rt.registerZ3Param(8806, {7, -1}, shard, emptyF(3), false, std::nullopt); },
            {"register_z3_param", "8806"}));

        // Exactly a shard, or more, is fine.
        rt.registerZ3Param(8807, {7}, shard, emptyF(3), false, std::nullopt);
        rt.registerZ3Param(8808, {7}, shard.clone(), emptyF(10), false, std::nullopt);
        EXPECT_FALSE(rt.isParamFrozen(8807));
        // Replacing the buffer later is checked the same way.
        EXPECT_TRUE(throwsNaming([&] { rt.updateParamGradBuffer(8807, emptyF(2), 0); },
                                 {"update_param_grad_buffer", "8807"}));
        rt.updateParamGradBuffer(8807, emptyF(3), 0);

        // ZeRO-1/2: the param must match ds_shape and the buffer must fit inside it.
        EXPECT_TRUE(throwsNaming([&] { rt.registerParam(8809, {7}, emptyF(6), emptyF(3), 0); },
                                 {"register_param", "8809"}));
        EXPECT_TRUE(throwsNaming([&] { rt.registerParam(8810, {7}, emptyF(7), emptyF(3), 5); },
                                 {"register_param", "8810"}));
        // A refused registration leaves nothing behind (no entry without its grad buffer).
        EXPECT_TRUE(throwsNaming([&] { rt.paramState(8810); }, {"param_state", "8810"}));
        rt.registerParam(8811, {7}, emptyF(7), emptyF(3), 4);
        EXPECT_TRUE(throwsNaming([&] { rt.updateParamGradBuffer(8811, emptyF(3), 6); },
                                 {"update_param_grad_buffer", "8811"}));
    });
}

// H6: registering an id again replaces the entry; the next gather returns the new values even
// when a gathered copy of the old ones was still valid.
TEST(Registration, ReRegisteringReplacesTheShard)
{
    runRanks(2, smallConfig(), [&](int64_t rank, Runtime& rt) {
        const ShardLayout l = ShardLayout::of(5, 2);
        const at::Tensor old_full = fullParam(41, {5});
        const at::Tensor new_full = old_full.neg();
        rt.registerZ3Param(41, {5}, shardOf(old_full, l, rank), at::Tensor(), false, std::nullopt);
        rt.registerGraph(1, {41}, ZeroStage::Z3);
        at::Tensor before = rt.allgatherParam(1, 41, std::nullopt);
        EXPECT_TRUE(before.equal(old_full));
        // Not released: the old copy is still valid when the id is registered again.
        rt.registerZ3Param(41, {5}, shardOf(new_full, l, rank), emptyF(l.per_rank), false,
                           std::nullopt);
        EXPECT_FALSE(rt.isParamFrozen(41));  // the new registration's buffer counts
        at::Tensor after = rt.allgatherParam(1, 41, std::nullopt);
        EXPECT_TRUE(after.equal(new_full));
        EXPECT_TRUE(before.equal(old_full));  // the caller's old tensor is not overwritten
        rt.releaseParam(1, 41, 1);

        // A new shape too.
        const ShardLayout l2 = ShardLayout::of(9, 2);
        rt.registerZ3Param(41, {3, 3}, shardOf(fullParam(7, {3, 3}), l2, rank), at::Tensor(),
                           false, std::nullopt);
        at::Tensor reshaped = rt.allgatherParam(1, 41, std::nullopt);
        EXPECT_EQ(reshaped.sizes().vec(), (std::vector<int64_t>{3, 3}));
        EXPECT_TRUE(reshaped.equal(fullParam(7, {3, 3})));
        EXPECT_TRUE(rt.isParamFrozen(41));
        EXPECT_EQ(rt.stats().allgather_calls, 3);
    });
}

TEST(Registration, GraphListingAnIdTwiceIsRefused)
{
    auto rt = singleRankRuntime();
    registerZ3(*rt, 3, {4});
    EXPECT_TRUE(throwsNaming([&] { rt->registerGraph(62001, {3, 3}, ZeroStage::Z3); },
                             {"register_graph_z3", "62001", "3"}));
    EXPECT_TRUE(throwsNaming([&] { rt->registerGraph(62002, {5, 5}, ZeroStage::Z2); },
                             {"register_graph_z2", "62002"}));
    EXPECT_TRUE(rt->graphIds().empty());
}

// ---------------------------------------------------------------- H4: unknown ids

constexpr int64_t kGraph = 11;
constexpr int64_t kKnown = 7;
constexpr int64_t kOutsider = 5150;      // registered, but not a param of kGraph
constexpr int64_t kUnknownId = 918273;
constexpr int64_t kUnknownGraph = 646464;

class UnknownIds : public ::testing::Test {
protected:
    void SetUp() override
    {
        rt = singleRankRuntime();
        registerZ3(*rt, kKnown, {6});
        registerZ3(*rt, kOutsider, {2});
        rt->registerGraph(kGraph, {kKnown}, ZeroStage::Z3);
    }

    // The runtime still works after every refusal.
    void TearDown() override
    {
        if (!rt) { return; }
        at::Tensor full = rt->allgatherParam(kGraph, kKnown, std::nullopt);
        EXPECT_TRUE(full.equal(fullParam(kKnown, {6})));
        rt->releaseParam(kGraph, kKnown, 1);
    }

    std::unique_ptr<Runtime> rt;
};

const std::string kId = std::to_string(kUnknownId);
const std::string kG = std::to_string(kUnknownGraph);

TEST_F(UnknownIds, UnknownDsIdInEveryModuleFunction)
{
    Runtime& r = *rt;
    EXPECT_TRUE(throwsNaming([&] { r.updateParamGradBuffer(kUnknownId, emptyF(3), 0); },
                             {"update_param_grad_buffer", kId}));
    EXPECT_TRUE(throwsNaming([&] { r.registerGraph(3, {kKnown, kUnknownId}, ZeroStage::Z3); },
                             {"register_graph_z3", kId}));
    EXPECT_TRUE(throwsNaming([&] { r.setPersistent(kUnknownId); }, {"set_persistent", kId}));
    EXPECT_TRUE(throwsNaming([&] { r.setParamFrozen(kUnknownId, true); },
                             {"set_param_frozen", kId}));
    EXPECT_TRUE(throwsNaming([&] { r.isParamFrozen(kUnknownId); }, {"is_param_frozen", kId}));
    EXPECT_TRUE(throwsNaming([&] { r.invalidateGatheredParam(kUnknownId); },
                             {"invalidate_gathered_param", kId}));
    EXPECT_TRUE(throwsNaming([&] { r.paramState(kUnknownId); }, {"param_state", kId}));
    EXPECT_TRUE(throwsNaming([&] { r.gatheredMeta(kUnknownId, std::nullopt); },
                             {"allgather_param", kId}));
    // The failed register_graph_z3 registered nothing.
    EXPECT_EQ(r.graphIds(), (std::vector<int64_t>{kGraph}));
}

TEST_F(UnknownIds, UnknownDsIdInEveryOp)
{
    Runtime& r = *rt;
    const at::Tensor g = zerosF(6);
    EXPECT_TRUE(throwsNaming([&] { r.allgatherParam(kGraph, kUnknownId, std::nullopt); },
                             {"allgather_param", kId}));
    EXPECT_TRUE(throwsNaming(
        [&] { r.prefetchParamsFused(kGraph, {kKnown, kUnknownId}, std::nullopt); },
        {"prefetch_params_fused", kId}));
    EXPECT_TRUE(throwsNaming([&] { r.waitAllgather(kGraph, kUnknownId); },
                             {"wait_allgather", kId}));
    EXPECT_TRUE(throwsNaming([&] { r.releaseParam(kGraph, kUnknownId, 1); },
                             {"release_param", kId}));
    EXPECT_TRUE(throwsNaming([&] { r.reduceGrad(kGraph, kUnknownId, g); }, {"reduce_grad", kId}));
    EXPECT_TRUE(throwsNaming([&] { r.offloadParameter(kGraph, kUnknownId); },
                             {"offload_parameter", kId}));
    EXPECT_TRUE(throwsNaming([&] { r.reloadParameter(kGraph, kUnknownId); },
                             {"reload_parameter", kId}));
    // The failed prefetch gathered nothing (kKnown was listed before the unknown id).
    EXPECT_EQ(r.stats().allgather_calls, 0);
    EXPECT_EQ(r.pendingGradients(), 0u);
}

TEST_F(UnknownIds, IdOutsideTheGraphInEveryOp)
{
    Runtime& r = *rt;
    const std::string id = std::to_string(kOutsider);
    const std::string graph = std::to_string(kGraph);
    EXPECT_TRUE(throwsNaming([&] { r.allgatherParam(kGraph, kOutsider, std::nullopt); },
                             {"allgather_param", id, graph}));
    EXPECT_TRUE(throwsNaming([&] { r.prefetchParamsFused(kGraph, {kOutsider}, std::nullopt); },
                             {"prefetch_params_fused", id, graph}));
    EXPECT_TRUE(throwsNaming([&] { r.waitAllgather(kGraph, kOutsider); },
                             {"wait_allgather", id, graph}));
    EXPECT_TRUE(throwsNaming([&] { r.releaseParam(kGraph, kOutsider, 1); },
                             {"release_param", id, graph}));
    EXPECT_TRUE(throwsNaming([&] { r.reduceGrad(kGraph, kOutsider, zerosF(2)); },
                             {"reduce_grad", id, graph}));
    EXPECT_TRUE(throwsNaming([&] { r.offloadParameter(kGraph, kOutsider); },
                             {"offload_parameter", id, graph}));
    EXPECT_TRUE(throwsNaming([&] { r.reloadParameter(kGraph, kOutsider); },
                             {"reload_parameter", id, graph}));
    EXPECT_EQ(r.stats().allgather_calls, 0);
}

void expectEveryGraphOpRefuses(Runtime& r, int64_t graph_id)
{
    const std::string g = std::to_string(graph_id);
    const at::Tensor t = zerosF(6);
    EXPECT_TRUE(throwsNaming([&] { r.allgatherParam(graph_id, kKnown, std::nullopt); },
                             {"allgather_param", g}));
    EXPECT_TRUE(throwsNaming([&] { r.prefetchParamsFused(graph_id, {kKnown}, std::nullopt); },
                             {"prefetch_params_fused", g}));
    EXPECT_TRUE(throwsNaming([&] { r.waitAllgather(graph_id, kKnown); }, {"wait_allgather", g}));
    EXPECT_TRUE(throwsNaming([&] { r.releaseParam(graph_id, kKnown, 1); }, {"release_param", g}));
    EXPECT_TRUE(throwsNaming([&] { r.reduceGrad(graph_id, kKnown, t); }, {"reduce_grad", g}));
    EXPECT_TRUE(throwsNaming([&] { r.endBackward(graph_id, true); }, {"end_backward", g}));
    EXPECT_TRUE(throwsNaming([&] { r.offloadTensor(t, graph_id, 0); }, {"offload_tensor", g}));
    EXPECT_TRUE(throwsNaming([&] { r.reloadTensor(graph_id, 0); }, {"reload_tensor", g}));
    EXPECT_TRUE(throwsNaming([&] { r.waitOffload(graph_id, 0); }, {"wait_offload", g}));
    EXPECT_TRUE(throwsNaming([&] { r.waitReload(t, graph_id, 0); }, {"wait_reload", g}));
    EXPECT_TRUE(throwsNaming([&] { r.offloadParameter(graph_id, kKnown); },
                             {"offload_parameter", g}));
    EXPECT_TRUE(throwsNaming([&] { r.reloadParameter(graph_id, kKnown); },
                             {"reload_parameter", g}));
    EXPECT_EQ(r.stats().allgather_calls, 0);
    EXPECT_EQ(r.pendingGradients(), 0u);
}

TEST_F(UnknownIds, UnknownGraphIdInEveryOp) { expectEveryGraphOpRefuses(*rt, kUnknownGraph); }

TEST_F(UnknownIds, GraphAfterResetIsUnknown)
{
    rt->allgatherParam(kGraph, kKnown, std::nullopt);
    rt->releaseParam(kGraph, kKnown, 1);
    rt->reset();
    EXPECT_TRUE(rt->graphIds().empty());
    rt->resetStats();
    expectEveryGraphOpRefuses(*rt, kGraph);
    // Params survive reset(): registering the graph again brings everything back.
    EXPECT_FALSE(rt->isParamFrozen(kKnown));
    rt->registerGraph(kGraph, {kKnown}, ZeroStage::Z3);
}

TEST_F(UnknownIds, UnknownActivationIdNamesOpAndId)
{
    Runtime& r = *rt;
    EXPECT_TRUE(throwsNaming([&] { r.reloadTensor(kGraph, 777001); }, {"reload_tensor", "777001"}));
    EXPECT_TRUE(throwsNaming([&] { r.waitOffload(kGraph, 777002); }, {"wait_offload", "777002"}));
    EXPECT_TRUE(throwsNaming([&] { r.waitReload(zerosF(2), kGraph, 777003); },
                             {"wait_reload", "777003"}));
    // Offloaded but never reloaded.
    r.offloadTensor(zerosF(3), kGraph, 777004);
    EXPECT_TRUE(throwsNaming([&] { r.waitReload(zerosF(3), kGraph, 777004); },
                             {"wait_reload", "777004"}));
}

TEST_F(UnknownIds, PrefetchWithMismatchedDtypesNamesTheGraph)
{
    EXPECT_TRUE(throwsNaming(
        [&] {
            rt->prefetchParamsFused(kGraph, {kKnown},
                                    std::vector<at::ScalarType>{at::kFloat, at::kFloat});
        },
        {"prefetch_params_fused", std::to_string(kGraph)}));
    EXPECT_TRUE(throwsNaming(
        [&] { rt->prefetchParamsFused(kGraph, {kKnown, kKnown}, std::nullopt); },
        {"prefetch_params_fused", std::to_string(kKnown)}));
    EXPECT_EQ(rt->stats().allgather_calls, 0);
}

constexpr int64_t kGraphForLifetime = 4100;

TEST(CurrentRuntime, UseBeforeInitOrAfterCleanupNamesTheOp)
{
    current_runtime::destroy();
    EXPECT_EQ(current_runtime::tryGet(), nullptr);
    EXPECT_TRUE(throwsNaming([] { current_runtime::get("allgather_param"); },
                             {"allgather_param", "init"}));
    current_runtime::replace(singleRankRuntime());
    ASSERT_NE(current_runtime::tryGet(), nullptr);
    EXPECT_EQ(current_runtime::get("reduce_grad"), current_runtime::tryGet());
    // init() twice replaces the runtime.
    current_runtime::replace(singleRankRuntime());
    EXPECT_EQ(current_runtime::get("x")->worldSize(), 1);
    // cleanup() twice is harmless.
    current_runtime::destroy();
    current_runtime::destroy();
    EXPECT_TRUE(throwsNaming([] { current_runtime::get("end_backward"); }, {"end_backward"}));
}

TEST(CurrentRuntime, ACallKeepsItsRuntimeThroughCleanupAndInit)
{
    current_runtime::replace(singleRankRuntime());
    std::shared_ptr<Runtime> held = current_runtime::get("allgather_param");  // a running call
    registerZ3(*held, 31, {6});
    held->registerGraph(kGraphForLifetime, {31}, ZeroStage::Z3);
    current_runtime::destroy();                         // cleanup() from another thread
    current_runtime::replace(singleRankRuntime());      // and init()
    EXPECT_NE(current_runtime::get("x"), held);
    // The call's runtime is still whole: its params and graphs are there.
    at::Tensor full = held->allgatherParam(kGraphForLifetime, 31, std::nullopt);
    EXPECT_TRUE(full.equal(fullParam(31, {6})));
    EXPECT_TRUE(throwsNaming([] { current_runtime::get("x")->paramState(31); }, {"ds_id 31"}));
    current_runtime::destroy();
    EXPECT_EQ(held.use_count(), 1);  // the last call to return ends it
}

TEST(CurrentRuntime, DefaultsAreCheckedAndOutliveCleanup)
{
    current_runtime::setDefaults(RuntimeDefaults{4096}, "set_default_persistence_budget");
    current_runtime::replace(singleRankRuntime());
    current_runtime::destroy();
    EXPECT_EQ(current_runtime::defaults().persistence_budget_bytes, std::optional<int64_t>(4096));
    EXPECT_TRUE(throwsNaming(
        [] { current_runtime::setDefaults(RuntimeDefaults{-1}, "set_default_persistence_budget"); },
        {"set_default_persistence_budget", "-1"}));
    EXPECT_EQ(current_runtime::defaults().persistence_budget_bytes, std::optional<int64_t>(4096));
    current_runtime::setDefaults(RuntimeDefaults{}, "set_default_persistence_budget");
    EXPECT_FALSE(current_runtime::defaults().persistence_budget_bytes.has_value());
}

}  // namespace
}  // namespace dsz::test
