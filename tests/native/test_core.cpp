// The arithmetic and bookkeeping pieces of the core, one class at a time: ShardLayout,
// BucketCursor/ReduceBucket, GraphExecutor and ParamRegistry.
#include <ATen/ops/arange.h>

#include "core/bucket.h"
#include "core/executor.h"
#include "core/padding.h"
#include "core/param_registry.h"
#include "harness.h"

namespace dsz::test {
namespace {

// ---------------------------------------------------------------- ShardLayout

const std::vector<int64_t> kNumels = {0, 1, 2, 3, 5, 7, 8, 13, 16, 17, 1023, 1024, 1025, 4099};

TEST(ShardLayout, SweepWorldSizesAndOddSizes)
{
    for (int64_t ws = 1; ws <= 8; ++ws) {
        for (int64_t numel : kNumels) {
            SCOPED_TRACE("world_size " + std::to_string(ws) + " numel " + std::to_string(numel));
            const ShardLayout l = ShardLayout::of(numel, ws);
            EXPECT_EQ(l.numel, numel);
            EXPECT_EQ(l.world_size, ws);
            // per_rank is the smallest shard that covers numel.
            EXPECT_GE(l.per_rank * ws, numel);
            EXPECT_LT((l.per_rank - 1) * ws, numel == 0 ? 1 : numel);
            EXPECT_EQ(l.padded, l.per_rank * ws);
            EXPECT_EQ(l.padding(), l.padded - numel);
            EXPECT_GE(l.padding(), 0);
            EXPECT_LT(l.padding(), ws);
            int64_t valid_sum = 0;
            int64_t last_valid = l.per_rank;
            for (int64_t r = 0; r < ws; ++r) {
                EXPECT_EQ(l.shardBegin(r), r * l.per_rank);
                const int64_t v = l.validInShard(r);
                EXPECT_GE(v, 0);
                EXPECT_LE(v, l.per_rank);
                // Real data first, padding only at the end: valid counts never increase.
                EXPECT_LE(v, last_valid);
                last_valid = v;
                // Every element before the padding belongs to exactly one shard.
                EXPECT_EQ(v, std::max<int64_t>(0, std::min(l.per_rank, numel - r * l.per_rank)));
                valid_sum += v;
            }
            EXPECT_EQ(valid_sum, numel);
        }
    }
}

// ShardLayout::of(numel, ws) has these per_rank and padded, and validInShard(r) == valid[r] for
// every rank r of the ws.
void expectLayout(int64_t numel, int64_t ws, int64_t per_rank, int64_t padded,
                  const std::vector<int64_t>& valid)
{
    SCOPED_TRACE("numel " + std::to_string(numel) + " world_size " + std::to_string(ws));
    const ShardLayout l = ShardLayout::of(numel, ws);
    EXPECT_EQ(l.per_rank, per_rank);
    EXPECT_EQ(l.padded, padded);
    ASSERT_EQ(static_cast<int64_t>(valid.size()), ws);
    for (int64_t r = 0; r < ws; ++r) { EXPECT_EQ(l.validInShard(r), valid[r]) << "rank " << r; }
}

TEST(ShardLayout, KnownValues)
{
    expectLayout(7, 3, /*per_rank=*/3, /*padded=*/9, /*valid=*/{3, 3, 1});
    // More ranks than elements: trailing shards are all padding.
    expectLayout(2, 5, /*per_rank=*/1, /*padded=*/5, /*valid=*/{1, 1, 0, 0, 0});
    expectLayout(0, 4, /*per_rank=*/0, /*padded=*/0, /*valid=*/{0, 0, 0, 0});
}

TEST(ShardLayout, BadInputsThrowNamingTheOp)
{
    EXPECT_TRUE(throwsNaming([] { ShardLayout::of(-1, 2, "register_z3_param"); },
                             {"register_z3_param", "-1"}));
    EXPECT_TRUE(throwsNaming([] { ShardLayout::of(4, 0, "my_op"); }, {"my_op", "0"}));
    EXPECT_TRUE(throwsNaming([] { ShardLayout::of(4, -3, "my_op"); }, {"my_op", "-3"}));
    EXPECT_TRUE(throwsNaming([] { ShardLayout::of(-5, 1); }, {"shard_layout", "-5"}));
}

// ---------------------------------------------------------------- BucketCursor / ReduceBucket

TEST(BucketCursor, FlushAndGrowRules)
{
    BucketCursor c(10);
    EXPECT_TRUE(c.empty());
    // An empty bucket never needs a flush; it grows only for something larger than itself.
    EXPECT_FALSE(c.needsFlushFor(10));
    EXPECT_FALSE(c.needsFlushFor(11));
    EXPECT_FALSE(c.needsGrowFor(10));
    EXPECT_TRUE(c.needsGrowFor(11));

    EXPECT_EQ(c.take(4), 0);
    EXPECT_EQ(c.take(3), 4);
    EXPECT_EQ(c.used(), 7);
    EXPECT_FALSE(c.empty());
    EXPECT_FALSE(c.needsFlushFor(3));  // exactly full is fine
    EXPECT_TRUE(c.needsFlushFor(4));
    EXPECT_FALSE(c.needsGrowFor(100));  // a non-empty bucket is flushed, not grown
    EXPECT_EQ(c.take(3), 7);
    EXPECT_EQ(c.used(), 10);
    EXPECT_TRUE(c.needsFlushFor(1));
    EXPECT_FALSE(c.needsFlushFor(0));
}

TEST(BucketCursor, OverflowThrowsAndResetStartsOver)
{
    BucketCursor c(8);
    c.take(5);
    EXPECT_TRUE(throwsNaming([&] { c.take(4); }, {"reduce_bucket", "4", "overflows"}));
    EXPECT_EQ(c.used(), 5);  // a refused take reserves nothing
    EXPECT_TRUE(throwsNaming([&] { c.take(-1); }, {"reduce_bucket", "-1"}));
    // Growing a bucket in use would move slices already handed out.
    EXPECT_TRUE(throwsNaming([&] { c.grow(20); }, {"reduce_bucket", "5"}));
    c.reset();
    EXPECT_TRUE(c.empty());
    EXPECT_EQ(c.take(8), 0);
    c.reset();
    c.grow(20);
    EXPECT_EQ(c.capacity(), 20);
    c.grow(3);  // never shrinks
    EXPECT_EQ(c.capacity(), 20);
    EXPECT_EQ(c.take(20), 0);
}

TEST(BucketCursor, CapacityBelowOneThrows)
{
    EXPECT_TRUE(throwsNaming([] { BucketCursor c(0); }, {"reduce_bucket", "0"}));
    EXPECT_TRUE(throwsNaming([] { BucketCursor c(-2); }, {"reduce_bucket", "-2"}));
}

TEST(ReduceBucket, SlicesAreDisjointAndGrowOnlyWhenEmpty)
{
    ReduceBucket b(6, at::kFloat, c10::Device(c10::kCPU));
    EXPECT_FALSE(b.usedRegion().defined());
    at::Tensor s1 = b.take(2);
    at::Tensor s2 = b.take(4);
    EXPECT_EQ(s1.numel(), 2);
    EXPECT_EQ(s2.numel(), 4);
    EXPECT_EQ(s1.scalar_type(), at::kFloat);
    s1.fill_(1.0f);
    s2.fill_(2.0f);
    at::Tensor used = b.usedRegion();
    ASSERT_EQ(used.numel(), 6);
    // Both slices are views of one buffer, in order.
    EXPECT_TRUE(used.narrow(0, 0, 2).eq(1.0f).all().item<bool>());
    EXPECT_TRUE(used.narrow(0, 2, 4).eq(2.0f).all().item<bool>());
    EXPECT_EQ(s2.data_ptr<float>(), s1.data_ptr<float>() + 2);
    // Full: the next take must be preceded by a flush.
    EXPECT_TRUE(b.cursor().needsFlushFor(1));
    EXPECT_TRUE(throwsNaming([&] { b.take(1); }, {"reduce_bucket", "overflows"}));

    // After a reset an oversized request grows the (empty) bucket and gets one slice.
    b.cursor().reset();
    at::Tensor big = b.take(15);
    EXPECT_EQ(big.numel(), 15);
    EXPECT_EQ(b.cursor().capacity(), 15);
    EXPECT_EQ(b.usedRegion().numel(), 15);

    b.releaseMemory();
    EXPECT_FALSE(b.usedRegion().defined());
    EXPECT_TRUE(b.cursor().empty());
    EXPECT_EQ(b.take(3).numel(), 3);
}

// ---------------------------------------------------------------- GraphExecutor

TEST(GraphExecutor, UseCountsLastUserPerRound)
{
    GraphExecutor ex(42, ZeroStage::Z3, {10, 11});
    EXPECT_EQ(ex.graphId(), 42);
    EXPECT_EQ(ex.stage(), ZeroStage::Z3);
    EXPECT_EQ(ex.pendingUses(10), 0);
    // Three users: only the third release is the last.
    EXPECT_FALSE(ex.releaseUse(10, 3, "release_param"));
    EXPECT_EQ(ex.pendingUses(10), 2);
    EXPECT_FALSE(ex.releaseUse(10, 3, "release_param"));
    EXPECT_TRUE(ex.releaseUse(10, 3, "release_param"));
    EXPECT_EQ(ex.pendingUses(10), 0);
    // A new round starts the count afresh (the next forward pass).
    EXPECT_FALSE(ex.releaseUse(10, 2, "release_param"));
    EXPECT_TRUE(ex.releaseUse(10, 2, "release_param"));
    // One user: every release is the last. Counts are per id.
    EXPECT_TRUE(ex.releaseUse(11, 1, "release_param"));
    EXPECT_FALSE(ex.releaseUse(10, 2, "release_param"));
    EXPECT_TRUE(ex.releaseUse(11, 1, "release_param"));
    EXPECT_EQ(ex.pendingUses(10), 1);
}

TEST(GraphExecutor, NUsersBelowOneThrowsNamingGraphAndId)
{
    GraphExecutor ex(7001, ZeroStage::Z3, {8123});
    EXPECT_TRUE(throwsNaming([&] { ex.releaseUse(8123, 0, "release_param"); },
                             {"release_param", "8123", "7001"}));
    EXPECT_TRUE(throwsNaming([&] { ex.releaseUse(8123, -4, "release_param"); },
                             {"release_param", "8123", "7001", "-4"}));
    EXPECT_EQ(ex.pendingUses(8123), 0);
}

TEST(GraphExecutor, MembershipErrors)
{
    GraphExecutor ex(3003, ZeroStage::Z3, {1, 2, 5});
    EXPECT_TRUE(ex.contains(5));
    EXPECT_FALSE(ex.contains(3));
    EXPECT_EQ(ex.ids(), (std::vector<int64_t>{1, 2, 5}));
    EXPECT_NO_THROW(ex.requireMember(2, "allgather_param"));
    EXPECT_TRUE(throwsNaming([&] { ex.requireMember(9876, "allgather_param"); },
                             {"allgather_param", "9876", "3003"}));
    EXPECT_TRUE(throwsNaming([&] { ex.releaseUse(9876, 1, "release_param"); },
                             {"release_param", "9876", "3003"}));
}

TEST(GraphExecutor, Zero1LocalAccumulationLeavesCallerTensorAlone)
{
    GraphExecutor ex(1, ZeroStage::Z1, {4});
    at::Tensor g1 = at::arange(5, at::TensorOptions().dtype(at::kFloat));
    at::Tensor g2 = at::arange(5, at::TensorOptions().dtype(at::kFloat)).mul(10.0);
    const at::Tensor g1_copy = g1.clone();
    const at::Tensor g2_copy = g2.clone();
    EXPECT_FALSE(ex.takeLocal(4).defined());
    ex.accumulateLocal(4, g1);
    ex.accumulateLocal(4, g2);
    EXPECT_EQ(ex.localCount(), 1u);
    // The caller's gradients are unchanged (no in-place add into the first one).
    EXPECT_TRUE(g1.equal(g1_copy));
    EXPECT_TRUE(g2.equal(g2_copy));
    at::Tensor sum = ex.takeLocal(4);
    ASSERT_TRUE(sum.defined());
    EXPECT_TRUE(sum.equal(g1_copy.add(g2_copy)));
    EXPECT_NE(sum.data_ptr(), g1.data_ptr());
    // Taken means gone: the next window starts from nothing.
    EXPECT_EQ(ex.localCount(), 0u);
    EXPECT_FALSE(ex.takeLocal(4).defined());
    ex.accumulateLocal(4, g2);
    EXPECT_TRUE(ex.takeLocal(4).equal(g2_copy));
}

// ---------------------------------------------------------------- ParamRegistry

TEST(ParamRegistry, PutReplacesAndGetNamesUnknownIds)
{
    ParamRegistry reg;
    ParamEntry a;
    a.ds_id = 31;
    a.numel = 4;
    a.shard = zerosF(4);
    EXPECT_FALSE(reg.put(a));
    EXPECT_TRUE(reg.contains(31));
    EXPECT_EQ(reg.size(), 1u);

    ParamEntry b;
    b.ds_id = 31;
    b.numel = 9;
    b.shard = zerosF(9);
    EXPECT_TRUE(reg.put(b));  // replaced, not kept
    EXPECT_EQ(reg.size(), 1u);
    EXPECT_EQ(reg.get(31, "test").numel, 9);

    EXPECT_TRUE(throwsNaming([&] { reg.get(74205, "wait_allgather"); },
                             {"wait_allgather", "74205"}));
    const ParamRegistry& cref = reg;
    EXPECT_TRUE(throwsNaming([&] { cref.get(74206, "param_state"); }, {"param_state", "74206"}));
    reg.clear();
    EXPECT_FALSE(reg.contains(31));
}

TEST(ParamEntry, GradBufferPredicates)
{
    ParamEntry p;
    p.layout = ShardLayout::of(7, 3);
    EXPECT_FALSE(p.hasGradBuffer());  // undefined
    p.grad_buffer = emptyF(0);
    EXPECT_FALSE(p.hasGradBuffer());  // empty
    p.grad_buffer = emptyF(3);
    EXPECT_TRUE(p.hasGradBuffer());
    EXPECT_EQ(p.requiredGradNumel(), 3);
    p.partitioned = false;
    EXPECT_EQ(p.requiredGradNumel(), 0);
}

}  // namespace
}  // namespace dsz::test
