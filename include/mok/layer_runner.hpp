// Runs the GPU layer forward (LayerForward) — and, when asked, the backward (LayerBackward) — for
// every rank of one process, times it and returns the outputs: what `mok run --backend cuda` and
// bench_layer share. Plain C++ interface (no CUDA headers),
// so the command-line tool includes it as it is.
//
// Rank r of R drives GPU r and holds tokens [r*T, (r+1)*T) and experts [r*E/R, (r+1)*E/R) of the
// global problem, as Problem::rank_inputs does. Timing: `warmup` forwards (for at least
// `warmup_ms`), then `iterations`
// forwards each between two CUDA events on every rank's stream (no host sync between them); a
// rank's figure is the median, the layer's figure the slowest rank's (DESIGN.md §5).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "mok/bf16.hpp"
#include "mok/precision.hpp"
#include "mok/shape.hpp"
#include "mok/synthetic.hpp"

namespace mok {

struct LayerRunSpec {
  LayerShape shape;
  int ep = 1;
  int64_t tokens_per_rank = 0;
  // Global routing (T_global, k), e.g. a Problem's topk_idx and topk_w.
  const std::vector<int32_t>* topk_idx = nullptr;
  const std::vector<float>* topk_w = nullptr;
  // x and weights from this problem (host), or, when null, seeded random values made on the
  // device (for shapes whose host generation would take minutes: the timing does not depend on
  // the values).
  const Problem* problem = nullptr;
  uint64_t seed = 0;
  int gemm_sms = 0;   // 0 = every SM
  int copy_ctas = 0;  // 0 = the layer's default
  // The fused kernel (LayerForwardOptions::fused), else the unfused composition; 0 = default.
  bool fused = true;
  int fused_comm_ctas = 0;
  int fused_minibatch_rows = 0;
  int64_t fused_ring_rows = 0;  // 0 = one round (FusedForwardOptions::ring_rows)
  bool fused_schedule_in_kernel = true;
  int fused_schedule_ctas = 0;             // 0 = every CTA
  bool fused_l2_partition_tickets = true;  // FusedForwardOptions::l2_partition_tickets
  // Before the warm-up, one forward with every expert id shifted by one, so that the row buffers
  // hold rows of another routing where this one pads, as in training, where the routing changes
  // every step. The MMAs multiply up to 63 padding rows per expert, and with a fresh allocation's
  // zeros there the forward ran faster at deepseek-v3 EP1 (docs/perf-notes/layer.md): a figure
  // training would not see.
  bool stale_rows = true;
  // After the timed forwards, one more with the fused kernel's per-CTA timeline, summarised.
  bool trace = false;
  // After the forward's timing, the GPU backward (LayerBackward) on the same inputs and a dy
  // (the problem's, or seeded random values): timed alone and as forward + backward pairs, after
  // the same warm-up (of pairs). Its outputs are kept with y (keep_y).
  bool backward = false;
  // The backward timed in save mode too (the pairs' forwards keep the gate/up pre-activations
  // and the backward reads them), after recompute mode; the outputs are save mode's.
  bool save_context = true;
  // The backward's weight gradients in bf16 (what autograd gives bf16 parameters), else fp32.
  bool bf16_gradients = false;
  // The backward's GEMM engine, as gemm::GemmEngine's value (0 = kAuto; same bits whichever).
  int backward_engine = 0;
  // CTAs per cluster of the backward's wgrad GEMMs (gemm::LaunchOptions::wgrad_cluster; 0 = the
  // default; same bits whichever).
  int wgrad_cluster = 0;
  // With `backward`, save_context and EP 1: save mode again with the low-memory backward (the
  // routed experts in chunks of 1.5 T rows: LayerBackwardOptions::chunk_rows), timed after save
  // mode without a phase breakdown, its outputs checked bitwise against save mode's.
  bool chunked_backward = false;
  // After the forward's timing, the forward in the FP8 mode fp8_precision on the same inputs and
  // weights (fp8: LayerForwardFp8; mxfp8: LayerForwardMxfp8, the numerics mode on the bf16
  // engine): the weight cache quantized once (timed), then warmed up and timed as the bf16 forward
  // is; its y kept in fp8_y (keep_y). H, I and I_s multiples of the mode's block. With `backward`,
  // then the mode's training step (LayerBackwardFp8 or LayerBackwardMxfp8, bf16 weight gradients)
  // timed as the bf16 pairs are, each step from the weights' quantization (both layouts) to the
  // backward's end. The fp8_* figures below are the mode's, whichever it is.
  bool fp8_forward = false;
  Precision fp8_precision = Precision::kFp8;  // kFp8 or kMxfp8
  int fp8_cluster = 0;  // fp8's GEMMs' CTAs per cluster (1 or 2; 0 = LayerForwardFp8Options')
  int warmup = 3;       // untimed forwards first: at least this many, and
  // more until this many milliseconds have passed (every rank runs as many as rank 0): under the
  // power cap the clock follows the power of the last fraction of a second, so a few forwards of
  // warm-up time the first iterations at the clock the idle GPU left (docs/perf-notes/layer.md).
  double warmup_ms = 0;
  int iterations = 20;
  bool keep_y = true;  // download y (global, (T_global, H)) after the last forward
  // When set, rank 0's thread calls it with begin = true just before each timed loop is enqueued
  // (after its warm-up) and with begin = false once the loop's work has finished, naming the loop:
  // "fwd", "fwdbwd-recompute", "fwdbwd" (save mode), and for the FP8 mode "<mode>-fwd",
  // "<mode>-fwdbwd-recompute", "<mode>-fwdbwd-cached", "<mode>-fwdbwd" (mode: "fp8" or "mxfp8").
  // bench_layer samples the GPU's clock and power in these windows.
  std::function<void(const std::string& loop, bool begin)> timed_loop;
};

struct LayerRunResult {
  std::vector<bf16> y;          // (T_global, H) when keep_y
  double forward_ms = 0;        // median over iterations, slowest rank
  std::vector<double> rank_ms;  // median of each rank
  // Per step of the forward (LayerForward's phases, in order): the median over iterations, the
  // slowest rank. Steps that wait for a peer include the wait.
  std::vector<std::string> phase_names;
  std::vector<double> phase_ms;
  int64_t buffer_bytes_per_rank = 0;  // workspace and intermediates, weights excluded
  // spec.backward: medians over the timed pairs, slowest rank, in save mode (recompute mode when
  // not spec.save_context) and in recompute mode; the backward's own buffers and the saved
  // context's bytes; and, with keep_y, every output in global layout (weight gradients fp32,
  // gate/up interleaved as DeviceLayerWeights; the shared expert's per rank, (ep, ...)).
  double backward_ms = 0;
  double forward_backward_ms = 0;
  double backward_recompute_ms = 0;
  double forward_backward_recompute_ms = 0;
  int64_t backward_buffer_bytes_per_rank = 0;
  int64_t saved_context_bytes_per_rank = 0;
  // spec.chunked_backward: the low-memory backward's medians and buffers, and whether every output
  // had save mode's bits (dx, d_topk_w and every weight gradient).
  double backward_chunked_ms = 0;
  double forward_backward_chunked_ms = 0;
  int64_t backward_chunked_buffer_bytes_per_rank = 0;
  bool chunked_same_bits = false;
  std::vector<std::string> backward_phase_names;  // LayerBackward's phases, in order
  std::vector<double> backward_phase_ms;          // median over the timed pairs, slowest rank
  std::vector<double> backward_recompute_phase_ms;
  std::vector<bf16> dx;                    // (T_global, H)
  std::vector<float> d_topk_w;             // (T_global, k)
  std::vector<float> grad_gate_up;         // (E, 2I, H)
  std::vector<float> grad_down;            // (E, H, I)
  std::vector<float> grad_shared_gate_up;  // (ep, 2I_s, H)
  std::vector<float> grad_shared_down;     // (ep, H, I_s)
  int64_t weight_bytes_per_rank = 0;
  // spec.fp8_forward: the FP8 mode's forward's median and phases (slowest rank; the phases' names
  // are phase_names), the weight quantization's time (once, slowest rank), its buffers and cache.
  double fp8_forward_ms = 0;
  std::vector<double> fp8_phase_ms;
  double fp8_weight_quantize_ms = 0;
  int64_t fp8_buffer_bytes_per_rank = 0;
  int64_t fp8_weight_bytes_per_rank = 0;
  std::vector<bf16> fp8_y;  // (T_global, H) when keep_y
  // spec.fp8_forward and spec.backward: the FP8 mode's backward's median and phases
  // (backward_phase_names) and the whole step's (weights quantized, forward, backward), slowest
  // rank, in save mode (the forward keeps its context, fp8_saved_context_bytes_per_rank), and in
  // recompute mode; its buffers. And the save mode step on the cached weights (forward,
  // backward): a gradient-accumulation step after the first, the weights unchanged since their
  // quantization.
  double fp8_backward_ms = 0;
  double fp8_step_ms = 0;
  double fp8_step_cached_weights_ms = 0;
  double fp8_backward_recompute_ms = 0;
  double fp8_step_recompute_ms = 0;
  int64_t fp8_saved_context_bytes_per_rank = 0;
  std::vector<double> fp8_backward_phase_ms;
  int64_t fp8_backward_buffer_bytes_per_rank = 0;
  std::vector<bf16> fp8_dx;                // (T_global, H) when keep_y
  std::vector<float> fp8_d_topk_w;         // (T_global, k) when keep_y
  std::vector<std::string> trace_summary;  // one line per rank when spec.trace
  // What each pass of rank 0's schedule took (µs; gather, count, scan, place) in its last forward
  // (the fused kernel's schedule CTAs, or the schedule kernel) and, with spec.backward, in its
  // last bf16 backward (the schedule kernel).
  std::vector<double> schedule_pass_us;
  std::vector<double> backward_schedule_pass_us;
  // How the fused kernel hands out its tasks on GPU 0: one pool, or a grant per L2 partition of
  // the SMs the probe found ("GPU 0 L2 partitions (probed): 66 + 66 SMs; ...").
  std::string l2_partitions;
};

// Throws mok::Error naming the argument (ep larger than the GPUs present, shapes) or the device
// fault (rank, phase, cause) that a forward recorded.
LayerRunResult run_layer_forward(const LayerRunSpec& spec);

// Empty when `ep` Hopper GPUs are visible and each has room for its share of the layer (weights,
// workspace, intermediates, inputs), else why not ("needs 2 GPUs, 1 visible").
// backward: room for the backward too (LayerBackward, fp32 weight gradients). fp8: room for the
// layer in the FP8 mode fp8_precision run beside the bf16 one, as run_layer_forward runs it
// (spec.fp8_forward: the weight cache, the mode's forward's and backward's buffers, their
// gradients and context).
std::string gpu_layer_unfit_reason(const LayerShape& shape, int ep, int64_t tokens_per_rank,
                                   bool backward = false, bool fp8 = false,
                                   Precision fp8_precision = Precision::kFp8);

}  // namespace mok
