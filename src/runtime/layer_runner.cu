// The GPU layer forward (and backward) for every rank of this process: inputs onto each GPU,
// warm-up, timed forwards and steps (layer_timing.hpp), outputs back (see layer_runner.hpp).
#include "mok/layer_runner.hpp"

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <memory>

#include "kernels/megakernel/task_list.cuh"
#include "kernels/megakernel/trace.cuh"
#include "mok/cuda_check.hpp"
#include "mok/device_buffer.hpp"
#include "mok/error.hpp"
#include "mok/gpu.hpp"
#include "mok/precision.hpp"
#include "runtime/comm.hpp"
#include "runtime/fp8_weights.hpp"
#include "runtime/l2_partitions.hpp"
#include "runtime/layer_backward.hpp"
#include "runtime/layer_backward_fp8.hpp"
#include "runtime/layer_backward_mxfp8.hpp"
#include "runtime/layer_forward.hpp"
#include "runtime/layer_forward_fp8.hpp"
#include "runtime/layer_forward_mxfp8.hpp"
#include "runtime/layer_timing.hpp"
#include "runtime/mx_weights.hpp"

namespace mok {
namespace {

using runtime::BackwardTiming;
using runtime::fill_random;
using runtime::ForwardTiming;
using runtime::Fp8RankTimings;
using runtime::median;
using runtime::run_backward;
using runtime::run_fp8_forward;
using runtime::time_forwards;
using runtime::WarmUp;

// One line on where the fused kernel's CTAs spent the traced forward (ms from the first CTA's
// start): the schedule, the dispatch, the task phase and its tail, and the per-CTA waits.
std::string summarize_trace(const std::vector<uint64_t>& trace, int fields) {
  using namespace megakernel;
  const size_t ctas = trace.size() / static_cast<size_t>(fields);
  if (ctas == 0) return "no trace";
  auto field = [&](size_t cta, int which) { return trace[cta * fields + which]; };
  uint64_t start = UINT64_MAX, end = 0, dispatched = 0;
  std::vector<double> scheduled, tasks_end, ends, input_wait, slot_wait, publish, tasks;
  double schedule_wait = 0, kind_wait[kNumTaskKinds] = {};
  for (size_t cta = 0; cta < ctas; ++cta) start = std::min(start, field(cta, kTraceStart));
  auto ms = [&](uint64_t time) { return time > start ? (time - start) * 1e-6 : 0.0; };
  for (size_t cta = 0; cta < ctas; ++cta) {
    end = std::max(end, field(cta, kTraceEnd));
    dispatched = std::max(dispatched, field(cta, kTraceDispatched));
    scheduled.push_back(ms(field(cta, kTraceScheduled)));
    tasks_end.push_back(ms(field(cta, kTraceTasksEnd)));
    ends.push_back(ms(field(cta, kTraceEnd)));
    input_wait.push_back(field(cta, kTraceInputWaitNs) * 1e-6);
    slot_wait.push_back(field(cta, kTraceSlotWaitNs) * 1e-6);
    publish.push_back(field(cta, kTracePublishNs) * 1e-6);
    tasks.push_back(static_cast<double>(field(cta, kTraceTasks)));
    schedule_wait += field(cta, kTraceWaitScheduleNs) * 1e-6 / static_cast<double>(ctas);
    for (int kind = 0; kind < kNumTaskKinds; ++kind) {
      kind_wait[kind] += field(cta, kTraceWaitKindNs + kind) * 1e-6 / static_cast<double>(ctas);
    }
  }
  auto mean = [](const std::vector<double>& values) {
    double sum = 0;
    for (double value : values) sum += value;
    return sum / static_cast<double>(values.size());
  };
  char line[768];
  std::snprintf(line, sizeof(line),
                "fused kernel %.3f ms over %zu CTAs: schedule done %.3f (median), dispatch done "
                "%.3f, last task taken %.3f, CTAs end %.3f..%.3f (median %.3f); per CTA: input "
                "waits %.3f ms (schedule %.3f, rows %.3f, shared hidden %.3f, hidden %.3f), slot "
                "waits %.3f, gate/up publish %.3f, tasks %.0f..%.0f",
                ms(end), ctas, median(scheduled), ms(dispatched),
                *std::max_element(tasks_end.begin(), tasks_end.end()),
                *std::min_element(ends.begin(), ends.end()), ms(end), median(ends),
                mean(input_wait), schedule_wait, kind_wait[static_cast<int>(TaskKind::kGateUp)],
                kind_wait[static_cast<int>(TaskKind::kSharedDown)],
                kind_wait[static_cast<int>(TaskKind::kDown)], mean(slot_wait), mean(publish),
                *std::min_element(tasks.begin(), tasks.end()),
                *std::max_element(tasks.begin(), tasks.end()));
  return line;
}

}  // namespace

LayerRunResult run_layer_forward(const LayerRunSpec& spec) {
  const LayerShape& shape = spec.shape;
  shape.validate(spec.ep);
  const int64_t tokens = spec.tokens_per_rank, hidden = shape.hidden, top_k = shape.top_k;
  const int64_t global_tokens = tokens * spec.ep;
  MOK_CHECK_ARG(spec.topk_idx != nullptr && spec.topk_w != nullptr &&
                    static_cast<int64_t>(spec.topk_idx->size()) == global_tokens * top_k &&
                    static_cast<int64_t>(spec.topk_w->size()) == global_tokens * top_k,
                "topk_idx", "needs (", global_tokens, ", ", top_k, ") ids and weights");
  MOK_CHECK_ARG(spec.problem == nullptr || spec.problem->num_tokens == global_tokens, "problem",
                "holds ", spec.problem ? spec.problem->num_tokens : 0, " tokens, expected ",
                global_tokens);
  MOK_CHECK_ARG(spec.iterations >= 1, "iterations", "must be >= 1, got ", spec.iterations);
  MOK_CHECK_ARG(!spec.fp8_forward || spec.fp8_precision == Precision::kFp8 ||
                    spec.fp8_precision == Precision::kMxfp8,
                "fp8_precision", "an FP8 mode (fp8 or mxfp8), got ",
                precision_name(spec.fp8_precision));
  const std::vector<Communicator>& comms = local_communicators(spec.ep);

  LayerRunResult result;
  result.rank_ms.assign(spec.ep, 0.0);
  if (spec.keep_y) result.y.resize(static_cast<size_t>(global_tokens * hidden));
  std::vector<int64_t> buffer_bytes(spec.ep), weight_bytes(spec.ep);
  std::vector<std::vector<double>> rank_phase_ms(spec.ep, std::vector<double>(kNumForwardPhases));
  std::vector<std::string> trace_lines(spec.ep);
  std::vector<BackwardTiming> rank_recompute(spec.ep), rank_save(spec.ep);
  std::vector<int64_t> backward_bytes(spec.ep), context_bytes(spec.ep);
  if (spec.backward && spec.keep_y) {
    const int64_t experts = shape.num_experts, inter = shape.intermediate;
    const int64_t shared_inter = shape.shared_intermediate;
    result.dx.resize(static_cast<size_t>(global_tokens * hidden));
    result.d_topk_w.resize(static_cast<size_t>(global_tokens * top_k));
    result.grad_gate_up.resize(static_cast<size_t>(experts * 2 * inter * hidden));
    result.grad_down.resize(static_cast<size_t>(experts * hidden * inter));
    result.grad_shared_gate_up.resize(static_cast<size_t>(spec.ep * 2 * shared_inter * hidden));
    result.grad_shared_down.resize(static_cast<size_t>(spec.ep * hidden * shared_inter));
  }
  WarmUp warm_up_pairs(spec.ep);
  WarmUp warm_up_fp8(spec.ep), warm_up_fp8_pairs(spec.ep);
  std::vector<Fp8RankTimings> fp8_ranks(spec.ep);
  if (spec.fp8_forward && spec.keep_y) {
    result.fp8_y.resize(static_cast<size_t>(global_tokens * hidden));
    if (spec.backward) {
      result.fp8_dx.resize(static_cast<size_t>(global_tokens * hidden));
      result.fp8_d_topk_w.resize(static_cast<size_t>(global_tokens * top_k));
    }
  }

  WarmUp warm_up(spec.ep);
  for_each_rank(spec.ep, [&](int rank) {
    MOK_CUDA_CHECK(cudaSetDevice(comms[rank].device()));
    LayerForwardOptions options;
    options.gemm.num_sms = spec.gemm_sms;
    if (spec.copy_ctas > 0) options.copy.num_ctas = spec.copy_ctas;
    options.fused.enabled = spec.fused;
    options.fused.comm_ctas = spec.fused_comm_ctas;
    options.fused.minibatch_rows = spec.fused_minibatch_rows;
    options.fused.ring_rows = spec.fused_ring_rows;
    options.fused.schedule_in_kernel = spec.fused_schedule_in_kernel;
    options.fused.schedule_ctas = spec.fused_schedule_ctas;
    options.fused.l2_partition_tickets = spec.fused_l2_partition_tickets;
    LayerForward layer(comms[rank], shape, tokens, options);
    DeviceBuffer<bf16> x(tokens * hidden);           // (T, H)
    DeviceBuffer<int32_t> topk_idx(tokens * top_k);  // (T, k)
    DeviceBuffer<float> topk_w(tokens * top_k);      // (T, k)
    DeviceBuffer<bf16> y(tokens * hidden);           // (T, H)
    topk_idx.upload(spec.topk_idx->data() + rank * tokens * top_k);
    topk_w.upload(spec.topk_w->data() + rank * tokens * top_k);
    const DeviceLayerWeights& weights = layer.device_weights();
    if (spec.problem != nullptr) {
      layer.load_weights(spec.problem->rank_inputs(rank, spec.ep).weights);
      x.upload(spec.problem->x.data() + rank * tokens * hidden);
    } else {
      // Scales as Problem::generate: every intermediate near unit size. Streams by rank, so the
      // ranks hold different experts and tokens.
      const double in_scale = 1.0 / std::sqrt(static_cast<double>(hidden));
      fill_random(weights.gate_up, weights.gate_up_elements, in_scale, spec.seed, 10 + rank);
      fill_random(weights.down, weights.down_elements,
                  1.0 / std::sqrt(static_cast<double>(shape.intermediate)), spec.seed, 20 + rank);
      fill_random(weights.shared_gate_up, weights.shared_gate_up_elements, in_scale, spec.seed, 30);
      fill_random(
          weights.shared_down, weights.shared_down_elements,
          1.0 / std::sqrt(static_cast<double>(std::max<int64_t>(shape.shared_intermediate, 1))),
          spec.seed, 31);
      fill_random(x.get(), tokens * hidden, 1.0, spec.seed, 40 + rank);
      MOK_CUDA_CHECK(cudaDeviceSynchronize());
    }
    buffer_bytes[rank] = layer.buffer_bytes();
    weight_bytes[rank] = (weights.gate_up_elements + weights.down_elements +
                          weights.shared_gate_up_elements + weights.shared_down_elements) *
                         2;

    cudaStream_t stream = nullptr;
    MOK_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    std::unique_ptr<CUstream_st, void (*)(cudaStream_t)> stream_guard(
        stream, [](cudaStream_t s) { cudaStreamDestroy(s); });
    auto forward = [&] {
      layer.forward(x.get(), topk_idx.get(), topk_w.get(), y.get(), tokens, stream);
    };
    auto forward_saving = [&](const SavedContext* save) {
      layer.forward(x.get(), topk_idx.get(), topk_w.get(), y.get(), tokens, stream, nullptr, save);
    };
    if (spec.stale_rows) {
      std::vector<int32_t> shifted(spec.topk_idx->begin() + rank * tokens * top_k,
                                   spec.topk_idx->begin() + (rank + 1) * tokens * top_k);
      for (int32_t& expert : shifted) {
        if (expert >= 0) expert = static_cast<int32_t>((expert + 1) % shape.num_experts);
      }
      topk_idx.upload(shifted.data());
      forward();
      layer.check(stream);
      topk_idx.upload(spec.topk_idx->data() + rank * tokens * top_k);
    }
    warm_up.run(spec, rank, stream, forward);
    layer.check(stream);

    const ForwardTiming timing =
        time_forwards(spec, rank, "fwd", stream, [&](const cudaEvent_t* marks) {
          layer.forward(x.get(), topk_idx.get(), topk_w.get(), y.get(), tokens, stream, marks);
        });
    layer.check(stream);
    result.rank_ms[rank] = timing.ms;
    rank_phase_ms[rank] = timing.phase_ms;
    if (rank == 0) result.schedule_pass_us = layer.workspace().schedule_pass_us();
    if (spec.trace && spec.fused) {
      layer.enable_trace();
      forward();
      layer.check(stream);
      trace_lines[rank] = summarize_trace(layer.trace(stream), LayerForward::trace_fields());
    }
    if (spec.keep_y) {
      MOK_CUDA_CHECK(cudaMemcpy(result.y.data() + rank * tokens * hidden, y.get(),
                                static_cast<size_t>(tokens * hidden) * sizeof(bf16),
                                cudaMemcpyDeviceToHost));
    }
    if (spec.fp8_forward && spec.fp8_precision == Precision::kMxfp8) {
      LayerForwardMxfp8Options mxfp8_options;
      mxfp8_options.layer = options;
      mxfp8_options.dgrad_weights = spec.backward;  // (the weight quantization times both copies)
      LayerForwardMxfp8 mxfp8(comms[rank], shape, tokens, mxfp8_options);
      run_fp8_forward<LayerBackwardMxfp8>(spec, rank, comms[rank], mxfp8, weights, x.get(),
                                          topk_idx.get(), topk_w.get(), y.get(), stream,
                                          warm_up_fp8, warm_up_fp8_pairs, fp8_ranks[rank], result);
    } else if (spec.fp8_forward) {
      LayerForwardFp8Options fp8_options;
      fp8_options.layer = options;
      if (spec.fp8_cluster > 0) fp8_options.pipeline.cluster = spec.fp8_cluster;
      fp8_options.transposed_weights = spec.backward;  // (the weight quantization times both)
      LayerForwardFp8 fp8(comms[rank], shape, tokens, fp8_options);
      run_fp8_forward<LayerBackwardFp8>(spec, rank, comms[rank], fp8, weights, x.get(),
                                        topk_idx.get(), topk_w.get(), y.get(), stream, warm_up_fp8,
                                        warm_up_fp8_pairs, fp8_ranks[rank], result);
    }
    if (spec.backward) {
      run_backward(spec, rank, comms[rank], weights, x.get(), topk_idx.get(), topk_w.get(), stream,
                   forward_saving, warm_up_pairs, result, rank_recompute[rank], rank_save[rank],
                   backward_bytes[rank], context_bytes[rank]);
    }
  });
  if (spec.backward) {
    // The slowest rank's of each figure.
    const auto slowest = [&](const std::vector<BackwardTiming>& ranks, auto figure) {
      double value = 0;
      for (const BackwardTiming& timing : ranks) value = std::max(value, figure(timing));
      return value;
    };
    const auto summarise = [&](const std::vector<BackwardTiming>& ranks, double& backward_ms,
                               double& pair_ms, std::vector<double>& phase_ms) {
      backward_ms = slowest(ranks, [](const BackwardTiming& t) { return t.backward_ms; });
      pair_ms = slowest(ranks, [](const BackwardTiming& t) { return t.pair_ms; });
      phase_ms.clear();
      for (int phase = 0; phase < kNumBackwardPhases; ++phase) {
        phase_ms.push_back(
            slowest(ranks, [&](const BackwardTiming& t) { return t.phase_ms[phase]; }));
      }
    };
    summarise(rank_recompute, result.backward_recompute_ms, result.forward_backward_recompute_ms,
              result.backward_recompute_phase_ms);
    if (spec.save_context) {
      summarise(rank_save, result.backward_ms, result.forward_backward_ms,
                result.backward_phase_ms);
    } else {
      result.backward_ms = result.backward_recompute_ms;
      result.forward_backward_ms = result.forward_backward_recompute_ms;
      result.backward_phase_ms = result.backward_recompute_phase_ms;
    }
    result.backward_buffer_bytes_per_rank =
        *std::max_element(backward_bytes.begin(), backward_bytes.end());
    result.saved_context_bytes_per_rank =
        *std::max_element(context_bytes.begin(), context_bytes.end());
    for (int phase = 0; phase < kNumBackwardPhases; ++phase) {
      result.backward_phase_names.push_back(phase_name(static_cast<BackwardPhase>(phase)));
    }
  }
  if (spec.fp8_forward) {
    result.fp8_phase_ms.assign(kNumForwardPhases, 0.0);
    for (const Fp8RankTimings& fp8 : fp8_ranks) {  // the slowest rank's of each figure
      result.fp8_forward_ms = std::max(result.fp8_forward_ms, fp8.forward.ms);
      result.fp8_weight_quantize_ms = std::max(result.fp8_weight_quantize_ms, fp8.quantize_ms);
      result.fp8_buffer_bytes_per_rank =
          std::max(result.fp8_buffer_bytes_per_rank, fp8.buffer_bytes);
      result.fp8_weight_bytes_per_rank =
          std::max(result.fp8_weight_bytes_per_rank, fp8.weight_bytes);
      for (int phase = 0; phase < kNumForwardPhases; ++phase) {
        result.fp8_phase_ms[phase] =
            std::max(result.fp8_phase_ms[phase], fp8.forward.phase_ms[phase]);
      }
    }
    if (spec.backward) {
      result.fp8_backward_phase_ms.assign(kNumBackwardPhases, 0.0);
      for (const Fp8RankTimings& fp8 : fp8_ranks) {
        const BackwardTiming& step = fp8.steps.save;
        result.fp8_backward_ms = std::max(result.fp8_backward_ms, step.backward_ms);
        result.fp8_step_ms = std::max(result.fp8_step_ms, step.pair_ms);
        result.fp8_step_cached_weights_ms =
            std::max(result.fp8_step_cached_weights_ms, fp8.steps.cached.pair_ms);
        result.fp8_backward_recompute_ms =
            std::max(result.fp8_backward_recompute_ms, fp8.steps.recompute.backward_ms);
        result.fp8_step_recompute_ms =
            std::max(result.fp8_step_recompute_ms, fp8.steps.recompute.pair_ms);
        result.fp8_saved_context_bytes_per_rank =
            std::max(result.fp8_saved_context_bytes_per_rank, fp8.context_bytes);
        result.fp8_backward_buffer_bytes_per_rank =
            std::max(result.fp8_backward_buffer_bytes_per_rank, fp8.backward_buffer_bytes);
        for (int phase = 0; phase < kNumBackwardPhases; ++phase) {
          result.fp8_backward_phase_ms[phase] =
              std::max(result.fp8_backward_phase_ms[phase], step.phase_ms[phase]);
        }
      }
    }
  }
  result.forward_ms = *std::max_element(result.rank_ms.begin(), result.rank_ms.end());
  for (int phase = 0; phase < kNumForwardPhases; ++phase) {
    result.phase_names.push_back(phase_name(static_cast<ForwardPhase>(phase)));
    double slowest = 0;
    for (int rank = 0; rank < spec.ep; ++rank)
      slowest = std::max(slowest, rank_phase_ms[rank][phase]);
    result.phase_ms.push_back(slowest);
  }
  for (int rank = 0; rank < spec.ep && spec.trace; ++rank) {
    result.trace_summary.push_back(detail::concat("rank ", rank, ": ", trace_lines[rank]));
  }
  result.buffer_bytes_per_rank = *std::max_element(buffer_bytes.begin(), buffer_bytes.end());
  // The layers probed the map when they were built (kept for the process, so this reads it).
  MOK_CUDA_CHECK(cudaSetDevice(comms[0].device()));
  const runtime::L2PartitionMap& map = runtime::l2_partition_map();
  result.l2_partitions =
      map.num_partitions == 2
          ? detail::concat("GPU 0 L2 partitions (probed): ", map.sms_per_partition[0], " + ",
                           map.sms_per_partition[1], " SMs; fused tasks go out per partition")
          : std::string(
                "GPU 0 L2 partitions (probed): one found; fused tasks go out from one pool");
  result.weight_bytes_per_rank = *std::max_element(weight_bytes.begin(), weight_bytes.end());
  return result;
}

std::string gpu_layer_unfit_reason(const LayerShape& shape, int ep, int64_t tokens_per_rank,
                                   bool backward, bool fp8, Precision fp8_precision) {
  const GpuSummary gpus = query_gpus();
  if (gpus.num_hopper_gpus < ep) {
    return detail::concat("EP ", ep, " needs ", ep, " Hopper GPU(s); found ", gpus.description);
  }
  const comm::WorkspaceLayout layout =
      workspace_layout(shape, ep, tokens_per_rank, WorkspaceOptions{});
  const double weights = 2.0 * (shape.num_experts / ep * 3.0 * shape.intermediate * shape.hidden +
                                3.0 * shape.shared_intermediate * shape.hidden);
  const double buffers =
      static_cast<double>(layout.window_bytes + layout.local_bytes) +
      2.0 * layout.rows_capacity() * shape.intermediate +
      tokens_per_rank * (2.0 * shape.shared_intermediate + 4.0 * shape.hidden) +
      tokens_per_rank * (4.0 * shape.hidden + 8.0 * shape.top_k);  // x, y, topk_idx, topk_w
  // A backward's fp32-sized weight gradients, dy, dx and d_topk_w (BackwardBuffers).
  const double step_io = 2.0 * weights + tokens_per_rank * (4.0 * shape.hidden + 4.0 * shape.top_k);
  double backward_bytes = 0;
  if (backward) {  // LayerBackward's workspace and rows, and the step's buffers
    backward_bytes =
        static_cast<double>(LayerBackward::buffer_bytes(shape, ep, tokens_per_rank)) + step_io;
  }
  if (fp8) {  // the FP8 mode's layer beside the bf16 forward, before the bf16 backward (the larger)
    const int64_t experts = shape.num_experts / ep;
    const bool mx = fp8_precision == Precision::kMxfp8;
    // (the cache holds the backward's layout too when there is a backward)
    double fp8_bytes =
        static_cast<double>(mx ? MxWeightCache::bytes(shape, experts, backward) +
                                     LayerForwardMxfp8::buffer_bytes(shape, ep, tokens_per_rank)
                               : Fp8WeightCache::bytes(shape, experts, backward) +
                                     LayerForwardFp8::buffer_bytes(shape, ep, tokens_per_rank));
    if (backward) {
      const double context =
          2.0 * (saved_context_rows(ep, tokens_per_rank, shape.top_k, tokens_per_rank) * 2 *
                     shape.intermediate +
                 tokens_per_rank * 2 * shape.shared_intermediate);
      fp8_bytes +=
          static_cast<double>(mx ? LayerBackwardMxfp8::buffer_bytes(shape, ep, tokens_per_rank)
                                 : LayerBackwardFp8::buffer_bytes(shape, ep, tokens_per_rank)) +
          step_io + context;
    }
    backward_bytes = std::max(backward_bytes, fp8_bytes);
  }
  for (int device = 0; device < ep; ++device) {
    size_t free_bytes = 0, total_bytes = 0;
    MOK_CUDA_CHECK(cudaSetDevice(device));
    MOK_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
    if (weights + buffers + backward_bytes > 0.9 * static_cast<double>(free_bytes)) {
      return detail::concat("GPU ", device, " has ", static_cast<int64_t>(free_bytes >> 20),
                            " MiB free; the layer needs about ",
                            static_cast<int64_t>((weights + buffers + backward_bytes) / (1 << 20)),
                            " MiB per rank", backward ? " (forward and backward" : " (forward",
                            fp8 ? ", " : "", fp8 ? precision_name(fp8_precision) : "",
                            fp8 ? " beside bf16)" : ")");
    }
  }
  return "";
}

}  // namespace mok
