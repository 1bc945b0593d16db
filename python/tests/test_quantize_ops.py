"""mok.ops' FP8 quantizers: shapes and dtypes, agreement with torch's float8_e4m3fn cast where the
two define the same thing (finite inputs: the same round-to-nearest-even E4M3), the documented
difference (+-Inf: NaN here, +-448 in torch), scales, the transposed copy, round trips, the C++
dequantize against the Python one, errors, and (with a GPU) CUDA bytes = CPU bytes."""

import pytest
import torch

import mok
from mok import ops

FP8_VARIANTS = [((1, 128), False), ((128, 128), False), ((1, 128), True)]


def _values(shape, seed, dtype=torch.float32):
    """Normal values scaled per 32-element run by powers of two in [2^-140, 2^100], 1 % specials, a zero run."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=generator)
    flat = x.view(-1, 32)
    exponents = torch.randint(-140, 100, (flat.shape[0], 1), generator=generator).float()
    flat.mul_(torch.exp2(exponents))
    flat[0] = 0.0
    specials = torch.tensor([0.0, -0.0, float("nan"), float("inf"), -float("inf"), 448.0, -464.0, 1e-40, 3e38])
    where = torch.rand(x.shape, generator=generator) < 0.01
    picks = torch.randint(0, len(specials), x.shape, generator=generator)
    x = torch.where(where, specials[picks], x)
    return x.to(dtype)


def _bytes(tensor):
    return tensor.contiguous().view(torch.uint8)


def _over(numerator, tensor):
    """numerator / tensor, one rounding (torch's ``scalar / tensor`` multiplies by the reciprocal)."""
    return torch.full_like(tensor, numerator) / tensor


def _expected_fp8(x, block_rows):
    """fp8 1 x 128 or 128 x 128 of x (..., N, K), finite elements, with torch's own cast."""
    xf = x.float()
    finite = torch.where(torch.isfinite(xf), xf.abs(), torch.zeros_like(xf))
    if block_rows == 1:
        amax = finite.unflatten(-1, (-1, 128)).amax(-1)
        a = amax.clamp_min(2.0**-116)
        inverse = _over(448.0, a).repeat_interleave(128, -1)
    else:
        n = xf.shape[-2]
        padded = torch.nn.functional.pad(finite, (0, 0, 0, (-n) % 128))
        blocks = padded.unflatten(-2, (-1, 128)).unflatten(-1, (-1, 128))
        a = blocks.amax((-3, -1)).clamp_min(2.0**-116)
        inverse = _over(448.0, a).repeat_interleave(128, -2).repeat_interleave(128, -1)[..., :n, :]
    return (xf * inverse).to(torch.float8_e4m3fn), a / 448.0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("block,transposed", FP8_VARIANTS)
def test_fp8_matches_torch_cast_on_finite_values(dtype, block, transposed):
    x = _values((2, 256, 384), seed=1, dtype=dtype)
    q = ops.fp8_quantize(x, block=block, transposed=transposed)
    assert q.data.dtype == torch.float8_e4m3fn and q.scale.dtype == torch.float32
    source = x.mT.contiguous() if transposed else x
    assert q.data.shape == source.shape
    expected_data, expected_scale = _expected_fp8(source, block[0])
    assert q.scale.shape == expected_scale.shape
    assert torch.equal(_bytes(q.scale), _bytes(expected_scale))
    finite = torch.isfinite(source.float())
    assert torch.equal(_bytes(q.data)[finite], _bytes(expected_data)[finite])
    # where they differ: +-Inf become NaN here (torch's cast saturates them to +-448)
    nonfinite = _bytes(q.data)[~finite]
    signs = torch.signbit(source.float()[~finite]).to(torch.uint8)
    assert nonfinite.numel() > 0 and torch.equal(nonfinite, 0x7F | (signs << 7))


def test_mxfp8_scale_is_the_power_of_two_rounded_up_and_matches_torch_cast():
    x = _values((3, 64, 256), seed=2)
    q = ops.mxfp8_quantize(x)
    codes = q.scale.view(torch.uint8).to(torch.int64)
    assert q.scale.shape == (3, 64, 8)
    amax = torch.where(torch.isfinite(x), x.abs(), torch.zeros_like(x)).unflatten(-1, (-1, 32)).amax(-1).double()
    scale = torch.exp2(codes.double() - 127)
    assert bool((amax <= 448 * scale).all())  # nothing saturates
    smaller = codes > 0
    assert bool((amax[smaller] > 448 * scale[smaller] / 2).all())  # and no smaller power would do
    inverse = torch.exp2(127 - codes.double()).float().repeat_interleave(32, -1)
    expected = (x * inverse).to(torch.float8_e4m3fn)
    finite = torch.isfinite(x)
    assert torch.equal(_bytes(q.data)[finite], _bytes(expected)[finite])


@pytest.mark.parametrize("fmt", ["fp8", "mxfp8"])
def test_transposed_copy_is_the_quantized_transpose(fmt):
    x = _values((2, 256, 96), seed=3, dtype=torch.bfloat16)
    quantize = ops.fp8_quantize if fmt == "fp8" else ops.mxfp8_quantize
    a = quantize(x, transposed=True)
    b = quantize(x.mT.contiguous())
    assert a.data.shape == (2, 96, 256)
    assert torch.equal(_bytes(a.data), _bytes(b.data)) and torch.equal(_bytes(a.scale), _bytes(b.scale))


@pytest.mark.parametrize("block,transposed", FP8_VARIANTS)
def test_round_trip_and_cpp_dequantize(block, transposed):
    x = _values((2, 256, 256), seed=4)
    q = ops.fp8_quantize(x, block=block, transposed=transposed)
    y = ops.fp8_dequantize(q.data, q.scale, block=block)
    cpp = torch.ops.mok.dequantize(_bytes(q.data), q.scale, block[0], block[1])
    assert torch.equal(torch.nan_to_num(y), torch.nan_to_num(cpp)) and torch.equal(torch.isnan(y), torch.isnan(cpp))
    source = (x.mT if transposed else x).float()
    finite = torch.isfinite(source) & (source.abs() < 1e38)
    # half an E4M3 step: relative 2^-4 in the normal range, 2^-10 of the block scale below it
    block_scale = ops._expand(q.scale, q.data.shape, *block)
    error = (y - source).abs()[finite]
    bound = torch.maximum(source.abs()[finite] * 2.0**-4, block_scale[finite] * 2.0**-10) * (1 + 2.0**-18)
    assert bool((error <= bound).all())
    assert bool(torch.isnan(y[~torch.isfinite(source)]).all())


def test_mxfp8_round_trip_and_cpp_dequantize():
    x = _values((4, 128, 96), seed=5, dtype=torch.bfloat16)
    for transposed in (False, True):
        q = ops.mxfp8_quantize(x, transposed=transposed)
        y = ops.mxfp8_dequantize(q.data, q.scale)
        cpp = torch.ops.mok.dequantize(_bytes(q.data), q.scale.view(torch.uint8), 1, 32)
        assert torch.equal(torch.nan_to_num(y), torch.nan_to_num(cpp))
        assert torch.equal(torch.isnan(y), torch.isnan(cpp))
        source = (x.mT if transposed else x).float()
        finite = torch.isfinite(source) & (source.abs() < 1e38)
        block_scale = ops._expand(ops._e8m0_to_float(q.scale), q.data.shape, 1, 32)
        bound = torch.maximum(source.abs() * 2.0**-4, block_scale * 2.0**-10)
        assert bool(((y - source).abs() <= bound)[finite].all())


def test_zero_blocks_keep_signs_and_get_the_floor_scale():
    x = torch.zeros(2, 128)
    x[0, 1] = -0.0
    q = ops.fp8_quantize(x)
    assert torch.equal(q.scale, torch.full((2, 1), 2.0**-116 / 448))
    assert _bytes(q.data)[0, 1] == 0x80 and int(_bytes(q.data).sum()) == 0x80
    m = ops.mxfp8_quantize(x)
    assert int(m.scale.view(torch.uint8).max()) == 0


def test_bad_arguments_raise_value_errors_naming_them():
    with pytest.raises(ValueError, match="x: last dimension 100"):
        ops.fp8_quantize(torch.zeros(4, 100))
    with pytest.raises(ValueError, match="block"):
        ops.fp8_quantize(torch.zeros(128, 128), block=(128, 128), transposed=True)
    with pytest.raises(ValueError, match="x: rows"):
        ops.mxfp8_quantize(torch.zeros(48, 64), transposed=True)
    with pytest.raises(ValueError, match="x: expected dtype"):
        ops.mxfp8_quantize(torch.zeros(4, 64, dtype=torch.float16))


def test_fake_shapes_match():
    x = torch.zeros(3, 256, 384)
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        fake = mode.from_tensor(x)
        data, scale = torch.ops.mok.fp8_quantize(fake, 128, 128, False)
        mdata, mscale = torch.ops.mok.mxfp8_quantize(fake, True)
    real = torch.ops.mok.fp8_quantize(x, 128, 128, False)
    mreal = torch.ops.mok.mxfp8_quantize(x, True)
    assert data.shape == real[0].shape and scale.shape == real[1].shape and scale.dtype == real[1].dtype
    assert mdata.shape == mreal[0].shape and mscale.shape == mreal[1].shape and mscale.dtype == mreal[1].dtype


@pytest.mark.skipif(not (torch.cuda.is_available() and mok._ops.HAVE_GPU_LAYER),
                    reason="needs a CUDA GPU and a mok build with CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_bytes_equal_cpu_bytes(dtype):
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the quantize kernels are built for sm_90a")
    x = _values((2, 256, 256), seed=6, dtype=dtype)
    calls = [
        lambda t: ops.fp8_quantize(t),
        lambda t: ops.fp8_quantize(t[:, :200], block=(128, 128)),  # a partial row block
        lambda t: ops.fp8_quantize(t, transposed=True),
        lambda t: ops.mxfp8_quantize(t[..., 1:97]),  # a view at an unaligned offset
        lambda t: ops.mxfp8_quantize(t, transposed=True),
    ]
    for call in calls:
        cpu, gpu = call(x), call(x.cuda())
        assert torch.equal(_bytes(gpu.data).cpu(), _bytes(cpu.data))
        assert torch.equal(_bytes(gpu.scale).cpu(), _bytes(cpu.scale))
