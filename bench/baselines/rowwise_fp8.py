"""Rowwise FP8 for the torch-native layer baseline (torch_native.py --precision fp8): e4m3
quantization with one fp32 scale per row, and the expert FFNs on such operands by the scaled GEMMs
a PyTorch user has, torch._scaled_grouped_mm (routed experts) and torch._scaled_mm (shared expert).

Recipe (torch's rowwise scaling, as in torch_scaled_grouped_mm.py): a row's scale is its
amax / 448 (e4m3's largest finite value), its data the row divided by the scale, rounded to e4m3.
Activations get one scale per row over K (a token's H values of x, a routed row's I values of h),
weights one per output row (per expert and output feature of the [out, in] weight). A GEMM then
computes y[m, n] = scale_a[m] * scale_b[n] * sum_k a[m, k] * b[n, k], products and sums in fp32,
and rounds y to bf16 once.

On the CPU (smoke runs, tests) torch has no _scaled_grouped_mm: both GEMMs are emulated there by
that formula in fp32 on the same e4m3 values and scales, so the CPU path checks the layer's logic
and only the order of the fp32 sums differs from the GPU's kernels.
"""
import torch
import torch.nn.functional as F

E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
# An all-zero row's amax is raised to this, so that its scale is a finite, normal fp32
# (2^-116 / 448 > 2^-126) and its data stay zero.
MIN_AMAX = 2.0**-116


def quantize(values):
    """values (..., K) bf16 -> (data (..., K) e4m3, scale (...) fp32): one scale per row."""
    amax = values.abs().amax(dim=-1).float().clamp(min=MIN_AMAX)  # |bf16| and max are exact
    scale = amax / E4M3_MAX
    # NOTE: amax / scale can round a hair above 448; e4m3fn's conversion rounds that to 448 (only
    # values from 480 on become NaN), so no clamp pass is needed.
    data = (values / scale.unsqueeze(-1)).to(torch.float8_e4m3fn)  # the quotient in fp32
    return data, scale


def dequantize(data, scale):
    """fp32 values of quantize's (data (..., K), scale (...))."""
    return data.float() * scale.unsqueeze(-1)


def gather_rows(data, index):
    """data[index] of an e4m3 (rows, K) tensor, by its bytes (a uint8 view indexes on every torch)."""
    return data.view(torch.uint8)[index].view(torch.float8_e4m3fn)


def emulated_mm(a, b, scale_a, scale_b):
    """What the scaled GEMMs compute, in fp32: a (M, K), b (N, K) e4m3 -> (M, N) bf16."""
    product = a.float() @ b.float().t()
    return (product * scale_a.unsqueeze(-1) * scale_b.unsqueeze(0)).to(torch.bfloat16)


def scaled_mm(a, b, scale_a, scale_b):
    """a (M, K) e4m3 with scale_a (M,) times b (N, K) e4m3 ([out, in]) with scale_b (N,):
    (M, N) bf16, by torch._scaled_mm (b as its column-major (K, N) view)."""
    if not a.is_cuda:
        return emulated_mm(a, b, scale_a, scale_b)
    return torch._scaled_mm(a, b.t(), scale_a.unsqueeze(-1), scale_b.unsqueeze(0),
                            out_dtype=torch.bfloat16)


def scaled_grouped_mm(rows, weight, scale_rows, scale_weight, offs):
    """rows (M, K) e4m3 with scale_rows (M,), grouped by `offs` (int32 cumulative row ends, one
    per expert), times weight (E, N, K) e4m3 ([out, in]) with scale_weight (E, N): (M, N) bf16, by
    torch._scaled_grouped_mm (the weight as its column-major (E, K, N) view)."""
    if rows.is_cuda:
        return torch._scaled_grouped_mm(rows, weight.transpose(-2, -1), scale_rows, scale_weight,
                                        offs=offs, out_dtype=torch.bfloat16)
    ends = offs.tolist()
    starts = [0] + ends[:-1]
    pieces = [emulated_mm(rows[start:end], weight[expert], scale_rows[start:end], scale_weight[expert])
              for expert, (start, end) in enumerate(zip(starts, ends))]
    return torch.cat(pieces) if pieces else torch.empty(0, weight.shape[1], dtype=torch.bfloat16)


class RowwiseFp8Experts:
    """One rank's expert weights in e4m3 with one scale per output row, made once from its bf16
    weights (torch_native.ExpertWeights in [out, in] layout), as a training loop caches them once
    per optimizer step; and the expert FFNs on rowwise-quantized activations."""

    def __init__(self, weights):
        assert weights.layout == "out_in", f"weights: layout '{weights.layout}', expected 'out_in'"
        with torch.no_grad():
            # (E_l, 2I, H) and (E_l, 2I); (E_l, H, I) and (E_l, H)
            self.gate_up, self.gate_up_scale = quantize(weights.gate_up)
            self.down, self.down_scale = quantize(weights.down)
            self.shared_gate_up = self.shared_gate_up_scale = None
            self.shared_down = self.shared_down_scale = None
            if weights.shared_gate_up is not None:
                # (2I_s, H) and (2I_s,); (H, I_s) and (H,)
                self.shared_gate_up, self.shared_gate_up_scale = quantize(weights.shared_gate_up)
                self.shared_down, self.shared_down_scale = quantize(weights.shared_down)

    def tensors(self):
        return [t for t in (self.gate_up, self.gate_up_scale, self.down, self.down_scale,
                            self.shared_gate_up, self.shared_gate_up_scale, self.shared_down,
                            self.shared_down_scale) if t is not None]

    def nbytes(self):
        """Bytes of the e4m3 data and fp32 scales."""
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def routed(self, rows, row_scale, offs):
        """rows (M, H) e4m3 with row_scale (M,), grouped by expert (offs): the experts' outputs
        (M, H) bf16; h = silu(gate) * up in bf16, quantized per row for the down projection."""
        gate_up = scaled_grouped_mm(rows, self.gate_up, row_scale, self.gate_up_scale, offs)
        gate, up = gate_up.split(self.gate_up.shape[1] // 2, dim=-1)  # (M, I) each
        hidden, hidden_scale = quantize(F.silu(gate) * up)
        return scaled_grouped_mm(hidden, self.down, hidden_scale, self.down_scale, offs)

    def shared(self, x_data, x_scale):
        """The shared expert's output (T, H) in fp32 (as the bf16 layer's) of x (T, H) e4m3 with
        x_scale (T,); None without a shared expert."""
        if self.shared_gate_up is None:
            return None
        gate_up = scaled_mm(x_data, self.shared_gate_up, x_scale, self.shared_gate_up_scale)
        gate, up = gate_up.split(self.shared_gate_up.shape[0] // 2, dim=-1)  # (T, I_s) each
        hidden, hidden_scale = quantize(F.silu(gate) * up)
        return scaled_mm(hidden, self.shared_down, hidden_scale, self.shared_down_scale).float()
