// The fused forward (one persistent kernel for dispatch, the shared and routed expert GEMMs and
// the combine push) against the unfused composition bitwise, and through it against the CPU
// reference; EP=1 equals EP=2; ten repeats, graph replays and every setting of communication CTAs,
// minibatch, compute CTAs and ring size give the same bits (rings smaller than the received rows:
// several rounds). Routings: uniform, skewed, all tokens to one expert, empty experts, -1 slots;
// token counts that are not multiples of 128. The tail maps load zeros past each expert's rows.
#include <gtest/gtest.h>

#include <type_traits>
#include <vector>

#include "device_buffer.hpp"
#include "kernels/ptx/barrier.cuh"
#include "kernels/ptx/tma.cuh"
#include "layer_test_support.cuh"

namespace mok::comm_test {
namespace {

GpuRun fused_run(int comm_ctas = 0, int minibatch_rows = 0, int compute_sms = 0,
                 int64_t ring_rows = 0) {
  GpuRun run;
  run.layer.fused.enabled = true;
  run.layer.fused.comm_ctas = comm_ctas;
  run.layer.fused.minibatch_rows = minibatch_rows;
  run.layer.fused.ring_rows = ring_rows;
  run.layer.gemm.num_sms = compute_sms;
  return run;
}

TEST(FusedForwardEp1, EqualsUnfusedBitwiseAndRepeats) {
  MOK_REQUIRE_HOPPER_GPUS(1);
  for (bool wider : {false, true}) {
    SCOPED_TRACE(wider ? "H 512, I 192, top-6" : "H 256, I 128, top-4");
    const Problem problem = layer_problem({"uniform", 0.1, true, true}, 300, 11, wider);
    GpuRun fused = fused_run();
    fused.repeats = 3;
    fused.trace = wider;  // the timeline must not change a bit
    const std::vector<bf16> y = run_gpu_layer(problem, 1, fused);
    expect_matches_reference(problem, 1, y);
    EXPECT_EQ(first_difference(run_gpu_layer(problem, 1, GpuRun{}), y), -1)
        << "fused differs from unfused";
  }
}

class FusedForwardEp2 : public ::testing::TestWithParam<Case> {};

TEST_P(FusedForwardEp2, EqualsUnfusedAndEp1Bitwise) {
  MOK_REQUIRE_HOPPER_GPUS(2);
  const Problem problem = layer_problem(GetParam(), 2 * 173, 5, true);  // 173 tokens per rank
  GpuRun fused = fused_run(3, 256);
  fused.repeats = 2;
  fused.extra_capacity = 3;
  const std::vector<bf16> ep2 = run_gpu_layer(problem, 2, fused);
  expect_matches_reference(problem, 2, ep2);
  EXPECT_EQ(first_difference(run_gpu_layer(problem, 2, GpuRun{}), ep2), -1)
      << "fused differs from unfused";
  EXPECT_EQ(first_difference(run_gpu_layer(problem, 1, fused), ep2), -1)
      << "EP=1 differs from EP=2";
}

INSTANTIATE_TEST_SUITE_P(
    Routings, FusedForwardEp2,
    ::testing::Values(Case{"uniform", 0.0, false, true}, Case{"skewed:1.5", 0.0, true, true},
                      Case{"skewed:4", 0.0, false, true},  // most experts empty
                      Case{"single-expert", 0.0, false, false},
                      Case{"uniform", 0.35, true, false}),
    [](const auto& info) { return case_name(info.param); });

// Ten eager repeats at EP 2 with the default settings, where the tickets, the dispatch order and
// the arrival of each peer's rows differ from run to run: every run gives the first's bits, and
// those are the unfused path's.
TEST(FusedForwardEp2Repeats, TenRepeatsGiveTheSameBits) {
  MOK_REQUIRE_HOPPER_GPUS(2);
  const Problem problem = layer_problem({"skewed:1.2", 0.1, true, true}, 2 * 300, 47, true);
  GpuRun fused = fused_run();
  fused.repeats = 10;
  EXPECT_EQ(first_difference(run_gpu_layer(problem, 2, fused), run_gpu_layer(problem, 2, GpuRun{})),
            -1)
      << "fused differs from unfused";
}

TEST(FusedForwardEp2Settings, CommCtasMinibatchAndComputeCtasDoNotChangeABit) {
  MOK_REQUIRE_HOPPER_GPUS(2);
  const Problem problem = layer_problem({"skewed:1.2", 0.1, true, true}, 2 * 300, 21, true);
  const std::vector<bf16> expected = run_gpu_layer(problem, 2, GpuRun{});  // unfused
  expect_matches_reference(problem, 2, expected);
  struct Setting {
    int comm_ctas, minibatch_rows, compute_sms;
  };
  // One row block per minibatch with a single communication CTA and 2 compute CTAs: the longest
  // task list and the most waiting; then wider settings up to the defaults.
  for (const Setting setting : {Setting{1, 128, 2}, Setting{5, 384, 37}, Setting{20, 4096, 0},
                                Setting{64, 100000, 0}, Setting{0, 0, 0}}) {
    const GpuRun run = fused_run(setting.comm_ctas, setting.minibatch_rows, setting.compute_sms);
    EXPECT_EQ(first_difference(run_gpu_layer(problem, 2, run), expected), -1)
        << "comm CTAs " << setting.comm_ctas << ", minibatch rows " << setting.minibatch_rows
        << ", compute SMs " << setting.compute_sms << " differs from the unfused forward";
  }
  // The schedule made by a few CTAs (as few as the communication ones) while the rest start on
  // the shared gate/up tiles.
  for (const int schedule_ctas : {3, 17}) {
    GpuRun partial_schedule = fused_run(3, 256);
    partial_schedule.layer.fused.schedule_ctas = schedule_ctas;
    EXPECT_EQ(first_difference(run_gpu_layer(problem, 2, partial_schedule), expected), -1)
        << "the schedule on " << schedule_ctas << " CTAs differs from the unfused forward";
  }
  // Tickets from one pool for every CTA instead of a chunk per L2 partition.
  GpuRun one_pool = fused_run(3, 256);
  one_pool.layer.fused.l2_partition_tickets = false;
  EXPECT_EQ(first_difference(run_gpu_layer(problem, 2, one_pool), expected), -1)
      << "tickets from one pool differ from the unfused forward";
  GpuRun separate_schedule = fused_run(3, 256);
  separate_schedule.layer.fused.schedule_in_kernel = false;  // the schedule's own kernels first
  EXPECT_EQ(first_difference(run_gpu_layer(problem, 2, separate_schedule), expected), -1)
      << "the fused kernel after the schedule kernels differs from the unfused forward";
  EXPECT_EQ(first_difference(run_gpu_layer(problem, 1, fused_run(2, 128, 5)), expected), -1)
      << "EP=1 differs from EP=2";
}

// Each rank receives ~1,800 rows (2 x 300 tokens x top-6 / 2 ranks, plus padding); rings of 256
// to 1,000 rows take them in 2 to 8 rounds, the dispatch waiting for slots the gate/up tiles
// have read and the gate/up tiles for hidden rows the down tiles have read.
TEST(FusedForwardEp2Rings, RingsSmallerThanTheReceivedRowsDoNotChangeABit) {
  MOK_REQUIRE_HOPPER_GPUS(2);
  for (const Case& routing : {Case{"skewed:1.2", 0.1, true, true},
                              Case{"single-expert", 0.0, false, false}}) {
    SCOPED_TRACE(case_name(routing));
    const Problem problem = layer_problem(routing, 2 * 300, 41, true);
    const std::vector<bf16> expected = run_gpu_layer(problem, 2, GpuRun{});  // unfused
    expect_matches_reference(problem, 2, expected);
    struct Setting {
      int comm_ctas, minibatch_rows, compute_sms;
      int64_t ring_rows;
    };
    // The smallest ring (two blocks, one-block minibatches) with one communication CTA and two
    // compute CTAs: the most rounds and waits; a minibatch cut to half a ring that is no multiple
    // of it; a ring between the two.
    for (const Setting setting : {Setting{1, 128, 2, 256}, Setting{3, 4096, 0, 700},
                                  Setting{8, 256, 9, 1000}, Setting{0, 0, 0, 512}}) {
      GpuRun run = fused_run(setting.comm_ctas, setting.minibatch_rows, setting.compute_sms,
                             setting.ring_rows);
      run.repeats = 1;
      EXPECT_EQ(first_difference(run_gpu_layer(problem, 2, run), expected), -1)
          << "comm CTAs " << setting.comm_ctas << ", minibatch rows " << setting.minibatch_rows
          << ", compute SMs " << setting.compute_sms << ", ring rows " << setting.ring_rows
          << " differs from the unfused forward";
    }
    EXPECT_EQ(first_difference(run_gpu_layer(problem, 1, fused_run(2, 128, 5, 384)), expected), -1)
        << "EP=1 with a ring of 384 rows differs from EP=2 unfused";
  }
}

// The ring bounds the memory: the buffers shrink by what the ring leaves out of expert_x and the
// hidden rows (and the fused path holds no expert_y at all).
TEST(FusedForwardEp1Rings, RingBoundsTheBuffers) {
  MOK_REQUIRE_HOPPER_GPUS(1);
  const LayerShape shape = find_preset("tiny").shape;
  const Communicator& comm = local_communicators(1)[0];
  MOK_CUDA_CHECK(cudaSetDevice(comm.device()));
  LayerForwardOptions unfused;
  unfused.fused.enabled = false;
  LayerForwardOptions full, ring;
  ring.fused.ring_rows = 1024;
  const int64_t tokens = 4096;
  const int64_t unfused_bytes = LayerForward(comm, shape, tokens, unfused).buffer_bytes();
  const int64_t full_bytes = LayerForward(comm, shape, tokens, full).buffer_bytes();
  const int64_t ring_bytes = LayerForward(comm, shape, tokens, ring).buffer_bytes();
  const int64_t capacity = LayerForward(comm, shape, tokens, full).workspace().layout().rows_capacity();
  const int64_t row = shape.hidden * 2;
  const int64_t tail_maps = 2 * shape.num_experts * kTailMapBytes;
  EXPECT_EQ(unfused_bytes - full_bytes, capacity * row - tail_maps)
      << "the fused path holds an expert_y";
  EXPECT_GE(full_bytes - ring_bytes, (capacity - 1024) * (row + shape.intermediate * 2) - 8192)
      << "the ring does not bound expert_x and the hidden rows";
  LayerForwardOptions too_small;
  too_small.fused.ring_rows = 200;
  EXPECT_THROW(LayerForward(comm, shape, tokens, too_small), Error);
}

// The fused schedule (chunk counts, their scan, placement: token_schedule.cuh) gives the rows of
// the standalone schedule's order_rows bitwise: the same offsets, counts, rows in global token
// order within each expert, and padding. Over several routings, token counts that are not
// multiples of the chunk, and chunk boundaries inside a token's slots (T k = 300 * 6).
TEST(FusedForwardEp2Schedule, PlacesRowsAsTheOrderedSchedule) {
  MOK_REQUIRE_HOPPER_GPUS(2);
  for (const Case& routing : {Case{"skewed:1.2", 0.1, true, true}, Case{"uniform", 0.0, false, true},
                              Case{"single-expert", 0.0, false, false}}) {
    SCOPED_TRACE(case_name(routing));
    const Problem problem = layer_problem(routing, 2 * 300, 51, true);
    GpuRun run = fused_run(3, 256);
    std::vector<int> checked(2, 0);
    std::vector<int64_t> rows(2, 0);  // each rank's (all tokens to one expert: rank 1 gets none)
    run.after_first_run = [&](int rank, LayerForward& layer, cudaStream_t stream,
                              const int32_t* topk_idx, int64_t tokens) {
      CommWorkspace& ws = layer.workspace();
      const int64_t experts = ws.layout().experts_per_rank();
      auto download = [&](const int32_t* device, int64_t count) {
        std::vector<int32_t> host(static_cast<size_t>(count));
        MOK_CUDA_CHECK(cudaMemcpy(host.data(), device, host.size() * 4, cudaMemcpyDeviceToHost));
        return host;
      };
      const std::vector<int32_t> offsets = download(ws.view().offsets(), experts + 1);
      const std::vector<int32_t> counts = download(ws.view().counts(), experts);
      const std::vector<int32_t> placed = download(ws.view().row_source(), offsets[experts]);
      MOK_CUDA_CHECK(cudaMemset(ws.view().row_source(), 0x7f, ws.layout().rows_capacity() * 4));
      schedule(ws, topk_idx, tokens, stream);  // the standalone kernels: order_rows
      ws.check(stream);
      rows[rank] = offsets[experts];
      EXPECT_EQ(download(ws.view().offsets(), experts + 1), offsets) << "rank " << rank;
      EXPECT_EQ(download(ws.view().counts(), experts), counts) << "rank " << rank;
      EXPECT_EQ(download(ws.view().row_source(), offsets[experts]), placed) << "rank " << rank;
      checked[rank] = 1;
    };
    const std::vector<bf16> y = run_gpu_layer(problem, 2, run);
    EXPECT_EQ(checked, std::vector<int>({1, 1}));
    EXPECT_GT(rows[0] + rows[1], 0) << "no rank received rows: nothing was compared";
    EXPECT_EQ(first_difference(y, run_gpu_layer(problem, 2, GpuRun{})), -1)
        << "fused differs from unfused";
  }
}

// One k-block (64 columns, 128 rows from `row`) of a 2-D bf16 A map with the 128-byte swizzle,
// loaded by TMA as the GEMM's producer does, copied out as it lands in shared memory.
__global__ void load_a_box_kernel(const CUtensorMap* map, int32_t row, uint4* out) {
  constexpr int kBytes = 128 * 128;
  __shared__ __align__(1024) uint8_t tile[kBytes];
  __shared__ uint64_t barrier;
  if (threadIdx.x == 0) {
    ptx::mbarrier_init(&barrier, 1);
    ptx::fence_barrier_init();
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    ptx::fence_tensormap_acquire(map);
    ptx::mbarrier_arrive_expect_tx(&barrier, kBytes);
    ptx::tma_load_2d(tile, map, &barrier, 0, row);
  }
  ptx::mbarrier_wait(&barrier, 0);
  for (int i = static_cast<int>(threadIdx.x); i < kBytes / 16; i += static_cast<int>(blockDim.x)) {
    out[i] = reinterpret_cast<const uint4*>(tile)[i];
  }
}

// The tail maps the fused kernel writes (kernels/megakernel/tail_maps.cuh): loaded through them,
// each expert's last row block holds its rows, and zeros past them (expert_x and the hidden rows
// were NaN-poisoned before the forward, and the padding rows are not written), in both rings:
// one round, and a ring smaller than the rows (the tail blocks of later rounds).
TEST(FusedForwardEp1TailMaps, LastBlocksLoadZerosPastTheRows) {
  MOK_REQUIRE_HOPPER_GPUS(1);
  const Problem problem = layer_problem({"skewed:1.2", 0.1, true, true}, 600, 23, true);
  for (const int64_t ring_rows : {int64_t{0}, int64_t{512}}) {
    SCOPED_TRACE(::testing::Message() << "ring rows " << ring_rows);
    GpuRun run = fused_run(0, 256, 0, ring_rows);
    int tails = 0, later_rounds = 0;
    run.after_first_run = [&](int, LayerForward& layer, cudaStream_t, const int32_t*, int64_t) {
      CommWorkspace& ws = layer.workspace();
      const int64_t experts = ws.layout().experts_per_rank();
      const int64_t ring = ws.layout().expert_rows;  // rows of each ring
      auto download = [](const auto* device, int64_t count) {
        std::vector<std::remove_const_t<std::remove_pointer_t<decltype(device)>>> host(
            static_cast<size_t>(count));
        MOK_CUDA_CHECK(cudaMemcpy(host.data(), device, host.size() * sizeof(host[0]),
                                  cudaMemcpyDeviceToHost));
        return host;
      };
      const std::vector<int32_t> offsets = download(ws.view().offsets(), experts + 1);
      const std::vector<int32_t> counts = download(ws.view().counts(), experts);
      DeviceBuffer<uint4> box(128 * 128 / 16);
      const auto* maps = static_cast<const uint8_t*>(layer.tail_maps());
      ASSERT_NE(maps, nullptr);
      for (int64_t e = 0; e < experts; ++e) {
        const int rows = counts[e] % 128;
        if (rows == 0) continue;
        const int64_t first_row = offsets[e] + counts[e] / 128 * 128;
        // The ring's rows are its rounds' rows modulo the ring (a whole number of blocks).
        const int64_t ring_row = first_row % ring;
        later_rounds += first_row >= ring ? 1 : 0;
        ++tails;
        for (int kind = 0; kind < 2; ++kind) {
          SCOPED_TRACE(::testing::Message() << "expert " << e << (kind == 0 ? " expert_x" : " hidden"));
          const int64_t width = kind == 0 ? problem.shape.hidden : problem.shape.intermediate;
          const bf16* source = kind == 0 ? ws.expert_x() : layer.routed_hidden();
          load_a_box_kernel<<<1, 128>>>(
              reinterpret_cast<const CUtensorMap*>(maps + (kind * experts + e) * kTailMapBytes),
              static_cast<int32_t>(ring_row), box.get());
          MOK_CUDA_CHECK(cudaDeviceSynchronize());
          const std::vector<uint4> loaded = download(box.get(), 128 * 128 / 16);
          const std::vector<bf16> held = download(source + ring_row * width, 128 * width);
          for (int r = 0; r < 128; ++r) {
            for (int chunk = 0; chunk < 8; ++chunk) {  // 16 bytes: 8 bf16 of the row
              const uint4 got = loaded[r * 8 + (chunk ^ (r % 8))];  // the 128-byte swizzle
              uint4 want{0, 0, 0, 0};
              if (r < rows) std::memcpy(&want, &held[r * width + chunk * 8], 16);
              ASSERT_TRUE(got.x == want.x && got.y == want.y && got.z == want.z &&
                          got.w == want.w)
                  << "row " << r << " of the block (" << rows << " rows), 16 bytes " << chunk;
            }
          }
        }
      }
    };
    const std::vector<bf16> y = run_gpu_layer(problem, 1, run);
    EXPECT_GT(tails, 0) << "no expert with a tail block: nothing was checked";
    if (ring_rows > 0) EXPECT_GT(later_rounds, 0) << "no tail block in a later ring round";
    EXPECT_EQ(first_difference(y, run_gpu_layer(problem, 1, GpuRun{})), -1)
        << "fused differs from unfused";
  }
}

TEST(FusedForwardEp2Graph, GraphReplayEqualsEagerAndUnfused) {
  MOK_REQUIRE_HOPPER_GPUS(2);
  const Problem problem = layer_problem({"uniform", 0.2, true, true}, 2 * 250, 31, true);
  GpuRun run = fused_run(4, 512);
  run.use_graph = true;  // run_gpu_layer throws if a replay differs from the eager run
  run.callers_weights = true;
  EXPECT_EQ(first_difference(run_gpu_layer(problem, 2, run), run_gpu_layer(problem, 2, GpuRun{})),
            -1)
      << "fused differs from unfused";
}

}  // namespace
}  // namespace mok::comm_test
