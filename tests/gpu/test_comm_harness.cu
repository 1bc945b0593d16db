#include "test_comm_harness.cuh"

#include "mok/reference.hpp"

namespace mok::comm_test {

namespace {

// The GPU "reference expert": one thread per output element, a sequential fp32 sum over K in
// natural order with the explicitly rounded operations of numerics.hpp, so it gives the CPU
// reference's bits.
// Which rows an expert kernel computes: the dispatched rows of the local experts (offsets and
// row_source from the schedule), or rows 0..num_rows-1 of one expert (the shared expert).
struct ExpertRows {
  const int32_t* offsets = nullptr;     // (E_l + 1); null: one expert, num_rows rows
  const int32_t* row_source = nullptr;  // (rows); -1 = padding
  int32_t num_local_experts = 1;
  int32_t num_rows = 0;

  __device__ int32_t expert_of(int64_t row) const {  // -1: nothing to compute
    if (offsets == nullptr) return row < num_rows ? 0 : -1;
    if (row >= offsets[num_local_experts] || row_source[row] < 0) return -1;
    int32_t low = 0, high = num_local_experts - 1;  // last expert whose first row <= row
    while (low < high) {
      const int32_t middle = (low + high + 1) / 2;
      if (offsets[middle] <= row)
        low = middle;
      else
        high = middle - 1;
    }
    return low;
  }
};

__device__ inline float dot_natural_order(const __nv_bfloat16* weights, const __nv_bfloat16* values,
                                          int64_t length) {
  float sum = 0.0f;
  for (int64_t index = 0; index < length; ++index) {
    sum = numerics::add_rn(
        sum, numerics::mul_rn(__bfloat162float(weights[index]), __bfloat162float(values[index])));
  }
  return sum;
}

// hidden (rows, I) = bf16(swiglu(W_g x, W_u x)); W_g, W_u (experts, I, H); x (rows, H).
__global__ void reference_expert_hidden(ExpertRows rows, const __nv_bfloat16* x,
                                        const __nv_bfloat16* gate, const __nv_bfloat16* up,
                                        int64_t hidden, int64_t inter, int64_t capacity,
                                        __nv_bfloat16* out) {
  const int64_t item = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (item >= capacity * inter) return;
  const int64_t row = item / inter, column = item % inter;
  const int32_t expert = rows.expert_of(row);
  if (expert < 0) return;
  const __nv_bfloat16* x_row = x + row * hidden;
  const int64_t weight_row = (expert * inter + column) * hidden;
  const float gate_value = dot_natural_order(gate + weight_row, x_row, hidden);
  const float up_value = dot_natural_order(up + weight_row, x_row, hidden);
  out[item] = __float2bfloat16_rn(numerics::swiglu(gate_value, up_value));
}

// out (rows, H) = W_d h, as bf16 (routed) or fp32 (shared); W_d (experts, H, I); h (rows, I).
template <class Out>
__global__ void reference_expert_output(ExpertRows rows, const __nv_bfloat16* h,
                                        const __nv_bfloat16* down, int64_t hidden, int64_t inter,
                                        int64_t capacity, Out* out) {
  const int64_t item = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (item >= capacity * hidden) return;
  const int64_t row = item / hidden, column = item % hidden;
  const int32_t expert = rows.expert_of(row);
  if (expert < 0) return;
  const float value =
      dot_natural_order(down + (expert * hidden + column) * inter, h + row * inter, inter);
  if constexpr (sizeof(Out) == 2) {
    out[item] = __float2bfloat16_rn(value);
  } else {
    out[item] = value;
  }
}

template <class T>
std::vector<T> host_copy(const View<const T>& view) {
  return std::vector<T>(view.data, view.data + view.numel());
}

int64_t blocks_for(int64_t items) { return (items + 255) / 256; }

}  // namespace

std::vector<bf16> run_layer(const Problem& problem, int ep, const RunOptions& options) {
  return run_layer(problem, local_communicators(ep), options);
}

std::vector<bf16> run_layer(const Problem& problem, const std::vector<Communicator>& comms,
                            const RunOptions& options) {
  const int ep = static_cast<int>(comms.size());
  const LayerShape& shape = problem.shape;
  const int64_t tokens = problem.num_tokens / ep, hidden = shape.hidden;
  const int64_t inter = shape.intermediate, shared_inter = shape.shared_intermediate;
  std::vector<bf16> y_all(static_cast<size_t>(problem.num_tokens * hidden));

  for_each_rank(ep, [&](int rank) {
    MOK_CUDA_CHECK(cudaSetDevice(comms[rank].device()));
    const reference::RankInputs inputs = problem.rank_inputs(rank, ep);
    CommWorkspace ws(comms[rank], shape, tokens + options.extra_capacity, options.workspace);
    const int64_t capacity = ws.layout().rows_capacity();
    const int64_t experts_local = ws.layout().experts_per_rank();

    DeviceBuffer<bf16> x(host_copy(inputs.tokens.x));                         // (T, H)
    DeviceBuffer<int32_t> topk_idx(host_copy(inputs.tokens.topk_idx));        // (T, k)
    DeviceBuffer<float> topk_w(host_copy(inputs.tokens.topk_w));              // (T, k)
    DeviceBuffer<bf16> gate(host_copy(inputs.weights.gate));                  // (E_l, I, H)
    DeviceBuffer<bf16> up(host_copy(inputs.weights.up));                      // (E_l, I, H)
    DeviceBuffer<bf16> down(host_copy(inputs.weights.down));                  // (E_l, H, I)
    DeviceBuffer<bf16> routed_hidden(static_cast<size_t>(capacity * inter));  // (rows, I)
    const bool has_shared = shared_inter > 0;
    DeviceBuffer<bf16> shared_gate(has_shared ? host_copy(inputs.weights.shared_gate)
                                              : std::vector<bf16>{});
    DeviceBuffer<bf16> shared_up(has_shared ? host_copy(inputs.weights.shared_up)
                                            : std::vector<bf16>{});
    DeviceBuffer<bf16> shared_down(has_shared ? host_copy(inputs.weights.shared_down)
                                              : std::vector<bf16>{});
    DeviceBuffer<bf16> shared_hidden(static_cast<size_t>(tokens * shared_inter));  // (T, I_s)
    DeviceBuffer<float> shared_output(static_cast<size_t>(tokens * hidden));       // (T, H)
    DeviceBuffer<bf16> y(static_cast<size_t>(tokens * hidden));                    // (T, H)
    if (options.tamper) options.tamper(rank, topk_idx.get());

    cudaStream_t stream = nullptr;
    MOK_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    auto as_device = [](const bf16* pointer) {
      return reinterpret_cast<const __nv_bfloat16*>(pointer);
    };
    auto as_device_out = [](bf16* pointer) { return reinterpret_cast<__nv_bfloat16*>(pointer); };
    const ExpertRows routed_rows{ws.expert_offsets(), ws.row_source(),
                                 static_cast<int32_t>(experts_local), 0};
    const ExpertRows shared_rows{nullptr, nullptr, 1, static_cast<int32_t>(tokens)};

    auto enqueue = [&] {
      stage_tokens(ws, x.get(), tokens, stream);
      schedule(ws, topk_idx.get(), tokens, stream);
      if (options.dispatch_by_tokens) {
        dispatch_tokens(ws, options.copy, stream, x.get());
      } else {
        dispatch(ws, options.copy, stream);
      }
      reference_expert_hidden<<<blocks_for(capacity * inter), 256, 0, stream>>>(
          routed_rows, as_device(ws.expert_x()), as_device(gate.get()), as_device(up.get()), hidden,
          inter, capacity, as_device_out(routed_hidden.get()));
      reference_expert_output<__nv_bfloat16><<<blocks_for(capacity * hidden), 256, 0, stream>>>(
          routed_rows, as_device(routed_hidden.get()), as_device(down.get()), hidden, inter,
          capacity, as_device_out(ws.expert_y()));
      if (has_shared) {
        reference_expert_hidden<<<blocks_for(tokens * shared_inter), 256, 0, stream>>>(
            shared_rows, as_device(x.get()), as_device(shared_gate.get()),
            as_device(shared_up.get()), hidden, shared_inter, tokens,
            as_device_out(shared_hidden.get()));
        reference_expert_output<float><<<blocks_for(tokens * hidden), 256, 0, stream>>>(
            shared_rows, as_device(shared_hidden.get()), as_device(shared_down.get()), hidden,
            shared_inter, tokens, shared_output.get());
      }
      MOK_CUDA_CHECK_LAUNCH();
      combine_push(ws, options.copy, stream);
      combine_reduce(ws, topk_w.get(), has_shared ? shared_output.get() : nullptr, y.get(), tokens,
                     stream);
    };
    // NaN everywhere a step writes, so an element nobody wrote shows in y.
    auto poison = [&] {
      const size_t row_bytes = static_cast<size_t>(ws.layout().row_bytes());
      MOK_CUDA_CHECK(cudaMemsetAsync(y.get(), 0xff, y.size() * sizeof(bf16), stream));
      MOK_CUDA_CHECK(cudaMemsetAsync(ws.slots(), 0xff, ws.layout().slot_rows * row_bytes, stream));
      MOK_CUDA_CHECK(cudaMemsetAsync(ws.expert_x(), 0xff, capacity * row_bytes, stream));
      MOK_CUDA_CHECK(cudaMemsetAsync(ws.expert_y(), 0xff, capacity * row_bytes, stream));
      MOK_CUDA_CHECK(cudaMemsetAsync(shared_output.get(), 0xff, shared_output.size() * 4, stream));
    };

    poison();
    enqueue();
    ws.check(stream);
    std::vector<bf16> result = y.download();
    if (options.use_graph) {
      replay_in_graph(stream, enqueue, options.graph_replays, poison, [&](int replay) {
        ws.check(stream);
        const int64_t differs = first_difference(y.download(), result);
        MOK_CHECK_ARG(differs < 0, "graph", "rank ", rank, " replay ", replay,
                      " differs from the eager run at element ", differs);
      });
    }
    MOK_CUDA_CHECK(cudaStreamDestroy(stream));
    std::memcpy(y_all.data() + rank * tokens * hidden, result.data(), result.size() * sizeof(bf16));
  });
  return y_all;
}

std::vector<bf16> reference_y(const Problem& problem, int ep) {
  const std::vector<reference::RankInputs> inputs = problem.all_rank_inputs(ep);
  ProblemOutputs outputs = ProblemOutputs::poisoned(problem, ep);
  const std::vector<reference::RankOutputs> rank_outputs = outputs.rank_outputs(problem);
  reference::forward(problem.shape, inputs, rank_outputs);
  return outputs.y;
}

int64_t first_difference(const std::vector<bf16>& a, const std::vector<bf16>& b) {
  if (a.size() != b.size()) return 0;
  for (size_t index = 0; index < a.size(); ++index) {
    if (a[index].bits != b[index].bits) return static_cast<int64_t>(index);
  }
  return -1;
}

}  // namespace mok::comm_test
