"""CPU tests of the torch-native baseline (torch_native.py): every variant agrees with the fp32
reference and with the others, forward and training-step gradients, on the tiny preset and on
odd shapes; the per-expert loop that stands in for torch._grouped_mm where a CPU torch lacks it;
EP 2 under torchrun (gloo). --precision fp8: the rowwise quantization (rowwise_fp8.py) round-trips
within e4m3's precision and gives zero rows finite scales, the CPU emulation of the scaled GEMMs
computes what torch._scaled_mm does, and the FP8 variants pass their checks (a failing one is not
timed). Skipped where torch is not installed.

  python3 -m pytest -q bench/baselines/test_torch_native.py
"""
import json
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import data  # noqa: E402
import rowwise_fp8  # noqa: E402
import torch_native  # noqa: E402  (after the skip: it imports torch)
import torch_native_case  # noqa: E402
import torch_native_layer  # noqa: E402


def smoke(tmp_path, *extra):
    """Runs `measure --device cpu` in this process; returns (exit status, results)."""
    out = tmp_path / "smoke.json"
    args = torch_native.parse_args(["measure", "--device", "cpu", "--out", str(out),
                                    "--iterations", "1", "--warmup-ms", "0", *extra])
    status = torch_native.measure(args)
    return status, json.loads(out.read_text())


def assert_all_checked(results, variants=tuple(torch_native.VARIANTS)):
    for case in results["cases"].values():
        assert list(case["variants"]) == list(variants)
        for name, variant in case["variants"].items():
            check = variant["check"]
            assert check["passed"], (name, check)
            assert check["fwd_vs_reference"]["rel_rms"] < torch_native.TOLERANCE["rel_rms"]
            if name != variants[0]:
                assert set(check["grads_vs_first"]) >= {"x", "topk_w"}
                assert check["fwd_vs_first"]["rel_rms"] < torch_native.TOLERANCE["rel_rms"]
            for phase in ("fwd", "fwd_train", "fwdbwd", "bwd"):
                assert isinstance(variant[f"{phase}_ms"], float)
        assert case["fastest"]["fwd"] in variants


def test_tiny_preset_all_variants_agree(tmp_path):
    status, results = smoke(tmp_path, "--preset", "tiny", "--tokens", "48")
    assert status == 0
    assert_all_checked(results)
    case = results["cases"]["tiny-ep1"]
    grads = case["variants"]["batched_view_kn"]["check"]["grads_vs_first"]
    # x, router weights, the first and last local experts' weights, the shared expert's
    assert set(grads) == {"x", "topk_w", "expert0.gate_up", "expert0.down", "expert15.gate_up",
                          "expert15.down", "shared.gate_up", "shared.down"}
    assert results["dense_gemm_tflops"] if "dense_gemm_tflops" in results else True
    assert case["variants"]["index_add"]["peak_memory_gb"] == {"fwd": None, "fwdbwd": None}


def test_odd_shape_no_shared_expert_top1(tmp_path):
    status, results = smoke(tmp_path, "--preset", "tiny", "--hidden", "136", "--intermediate", "72",
                            "--experts", "5", "--top-k", "1", "--shared-intermediate", "0",
                            "--tokens", "17", "--name", "odd")
    assert status == 0
    assert results["cases"]["odd"]["shape"] == {"hidden": 136, "intermediate": 72,
                                                "shared_intermediate": 0, "num_experts": 5,
                                                "top_k": 1}
    assert_all_checked(results)


def test_loop_stands_in_for_grouped_mm(tmp_path):
    status, results = smoke(tmp_path, "--preset", "tiny", "--tokens", "24", "--grouped-mm-loop",
                            "--variants", "batched_view,index_add")
    assert status == 0
    assert results["grouped_mm"].startswith("per-expert loop")
    assert_all_checked(results, ("batched_view", "index_add"))


def test_loop_matches_grouped_mm():
    if not torch_native.cpu_has_grouped_mm():
        pytest.skip("this torch has no CPU torch._grouped_mm to compare with")
    generator = torch.Generator().manual_seed(0)
    rows = torch.randn(11, 16, generator=generator).to(torch.bfloat16)
    weight = torch.randn(3, 8, 16, generator=generator).to(torch.bfloat16).transpose(-2, -1)
    offs = torch.tensor([4, 4, 11], dtype=torch.int32)  # an expert with no rows
    native = torch_native_layer.grouped_mm(rows, weight, offs)
    loop = torch_native_layer.grouped_mm(rows, weight, offs, loop=True)
    torch.testing.assert_close(native.float(), loop.float(), rtol=2**-7, atol=2**-7)


def test_unused_slots():
    """Slots of -1 (no expert) add nothing, in every variant."""
    shape = dict(torch_native.PRESETS["tiny"])
    device = torch.device("cpu")
    layer = torch_native_layer.TorchNativeLayer(shape, 0, 1, device, full_topk=False)
    idx, w = torch_native.draw_routing(20, shape["num_experts"], shape["top_k"])
    idx[::3, 1] = -1
    idx[5, :] = -1  # a token routed nowhere: the shared expert alone
    x = data.uniform_std(20, shape["hidden"], std=1.0, device=device)
    reference = layer.reference(x, idx, w)
    for name, (layout, combine) in torch_native.VARIANTS.items():
        layer.weights.to_layout(layout)
        with torch.no_grad():
            y = layer.forward(x, idx, w, combine)
        error = torch_native_case.errors(y, reference)
        assert torch_native_case.within_tolerance(error), (name, error)


def test_bad_shape_names_the_argument(tmp_path):
    with pytest.raises(SystemExit, match="--top-k"):
        smoke(tmp_path, "--preset", "tiny", "--top-k", "17")
    with pytest.raises(SystemExit, match="--intermediate"):
        smoke(tmp_path, "--preset", "tiny", "--intermediate", "100")


def test_mok_cases_and_routing_file(tmp_path):
    """--mok: bench_layer's cases at this EP, with the routing it wrote."""
    shape = dict(torch_native.PRESETS["tiny"])
    idx, w = torch_native.draw_routing(32, shape["num_experts"], shape["top_k"], seed=5)
    routing = tmp_path / "tiny.bin"
    routing.write_bytes(idx.numpy().tobytes() + w.numpy().tobytes())
    case = {"name": "tiny-ep1", "preset": "tiny", "ep": 1, "tokens_per_rank": 32,
            "routing_file": str(routing), **shape}
    other = dict(case, name="tiny-ep2", ep=2)
    mok = tmp_path / "layer-mok.json"
    mok.write_text(json.dumps({"date": "2026-12-01T00:00:00Z", "cases": [case, other]}))
    status, results = smoke(tmp_path, "--mok", str(mok))
    assert status == 0
    assert list(results["cases"]) == ["tiny-ep1"]
    assert_all_checked(results)


def test_ep2_under_torchrun(tmp_path):
    out = tmp_path / "ep2.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
               os.path.join(HERE, "torch_native.py"), "measure", "--device", "cpu", "--ep", "2",
               "--preset", "tiny", "--tokens", "24", "--iterations", "1", "--warmup-ms", "0",
               "--out", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    results = json.loads(out.read_text())
    assert results["ep"] == 2
    assert_all_checked(results)


# ---------------------------------------------------------------------------------------------
# --precision fp8


def test_quantize_round_trips_within_e4m3_precision():
    generator = torch.Generator().manual_seed(3)
    # rows of very different magnitudes, each with values spread over several binades
    magnitudes = 2.0 ** torch.arange(-20, 20, 4, dtype=torch.float32)
    values = (torch.randn(len(magnitudes), 512, generator=generator) * magnitudes[:, None]).to(torch.bfloat16)
    data, scale = rowwise_fp8.quantize(values)
    assert data.dtype == torch.float8_e4m3fn and data.shape == values.shape
    assert scale.dtype == torch.float32 and scale.shape == (len(magnitudes),)
    # the largest element of each row lands on 448, the largest finite e4m3
    assert torch.equal(data.float().abs().amax(dim=-1), torch.full_like(scale, 448.0))
    restored = rowwise_fp8.dequantize(data, scale)
    error = (restored - values.float()).abs()
    # e4m3: 3 mantissa bits, half an ulp is 2^-4 relative; below 2^-6 (subnormals) the spacing is
    # 2^-9 of the scale, so half of it absolute
    bound = torch.maximum(2.0**-4 * values.float().abs(), 2.0**-10 * scale[:, None])
    assert bool((error <= bound * (1 + 2.0**-20)).all()), (error / bound).max()


def test_quantize_zero_rows_have_finite_scales():
    values = torch.zeros(3, 64, dtype=torch.bfloat16)
    values[1, 5] = -3.0  # one row that is not zero
    data, scale = rowwise_fp8.quantize(values)
    assert bool(torch.isfinite(scale).all()) and bool((scale > 0).all())
    restored = rowwise_fp8.dequantize(data, scale)
    assert bool(torch.isfinite(restored).all())
    assert torch.equal(restored[0], torch.zeros(64)) and torch.equal(restored[2], torch.zeros(64))
    assert restored[1, 5].item() == -3.0


def test_emulated_mm_matches_scaled_mm():
    generator = torch.Generator().manual_seed(4)
    a, scale_a = rowwise_fp8.quantize(torch.randn(24, 64, generator=generator).to(torch.bfloat16))
    b, scale_b = rowwise_fp8.quantize(torch.randn(32, 64, generator=generator).to(torch.bfloat16))
    emulated = rowwise_fp8.scaled_mm(a, b, scale_a, scale_b)  # on the CPU: emulated
    expected = (rowwise_fp8.dequantize(a, scale_a) @ rowwise_fp8.dequantize(b, scale_b).t())
    torch.testing.assert_close(emulated.float(), expected, rtol=2**-8, atol=1e-5)
    try:
        native = torch._scaled_mm(a, b.t(), scale_a[:, None], scale_b[None, :], out_dtype=torch.bfloat16)
    except (AttributeError, RuntimeError, NotImplementedError):
        pytest.skip("this torch has no CPU torch._scaled_mm to compare with")
    torch.testing.assert_close(emulated.float(), native.float(), rtol=2**-8, atol=1e-5)


def test_emulated_grouped_mm_per_expert():
    generator = torch.Generator().manual_seed(5)
    rows, row_scale = rowwise_fp8.quantize(torch.randn(11, 32, generator=generator).to(torch.bfloat16))
    weight, weight_scale = rowwise_fp8.quantize(torch.randn(3, 16, 32, generator=generator).to(torch.bfloat16))
    offs = torch.tensor([4, 4, 11], dtype=torch.int32)  # an expert with no rows
    out = rowwise_fp8.scaled_grouped_mm(rows, weight, row_scale, weight_scale, offs)
    assert out.shape == (11, 16) and out.dtype == torch.bfloat16
    for expert, (start, end) in enumerate(((0, 4), (4, 4), (4, 11))):
        expected = rowwise_fp8.scaled_mm(rows[start:end], weight[expert], row_scale[start:end],
                                         weight_scale[expert])
        assert torch.equal(out[start:end], expected)


def test_gather_rows_keeps_the_bytes():
    data, _ = rowwise_fp8.quantize(torch.randn(5, 16).to(torch.bfloat16))
    index = torch.tensor([4, 0, 0, 2])
    assert torch.equal(rowwise_fp8.gather_rows(data, index).float(), data.float()[index])


def assert_fp8_checked(results, variants=tuple(torch_native.FP8_VARIANTS)):
    assert results["precision"] == "fp8" and results["tolerance"] == torch_native.FP8_TOLERANCE
    for case in results["cases"].values():
        assert case["precision"] == "fp8" and isinstance(case["weight_quantize_ms"], float)
        assert 0 < case["fp8_weight_bytes_per_rank"] < case["weight_bytes_per_rank"]
        assert list(case["variants"]) == list(variants)
        for name, variant in case["variants"].items():
            check = variant["check"]
            assert check["passed"], (name, check)
            assert check["fwd_vs_reference"]["rel_rms"] < torch_native.FP8_TOLERANCE["rel_rms"]
            # FP8's error, which the bf16 tolerance would not pass: the check compares FP8 at all
            assert check["fwd_vs_reference"]["rel_rms"] > torch_native.TOLERANCE["rel_rms"]
            if name != variants[0]:
                assert check["fwd_vs_first"]["rel_rms"] < torch_native.TOLERANCE["rel_rms"]
            assert isinstance(variant["fwd_ms"], float)
            assert "fwdbwd_ms" not in variant and "bwd_ms" not in variant
        assert case["fastest"]["fwd"] in variants and case["fastest"]["fwdbwd"] is None


def test_fp8_tiny_preset(tmp_path):
    status, results = smoke(tmp_path, "--preset", "tiny", "--tokens", "48", "--precision", "fp8")
    assert status == 0
    assert_fp8_checked(results)
    assert results["grouped_mm"].startswith("emulated")
    assert list(results["cases"]) == ["tiny-ep1"]


def test_fp8_odd_shape_no_shared_expert_top1(tmp_path):
    status, results = smoke(tmp_path, "--preset", "tiny", "--hidden", "144", "--intermediate", "80",
                            "--experts", "5", "--top-k", "1", "--shared-intermediate", "0",
                            "--tokens", "17", "--name", "odd", "--precision", "fp8")
    assert status == 0
    assert results["cases"]["odd"]["shape"]["hidden"] == 144
    assert_fp8_checked(results)


def test_fp8_failing_variant_is_not_timed(tmp_path, monkeypatch):
    monkeypatch.setattr(torch_native_case, "FP8_TOLERANCE", {"rel_rms": 1e-9, "max_rel": 1e-9})
    status, results = smoke(tmp_path, "--preset", "tiny", "--tokens", "16", "--precision", "fp8")
    assert status == 1
    for variant in results["cases"]["tiny-ep1"]["variants"].values():
        assert not variant["check"]["passed"] and "fwd_ms" not in variant
    assert results["cases"]["tiny-ep1"]["fastest"]["fwd"] is None


def test_fp8_unused_slots():
    """Slots of -1 (no expert) add nothing in the FP8 forward either."""
    shape = dict(torch_native.PRESETS["tiny"])
    device = torch.device("cpu")
    layer = torch_native_layer.TorchNativeLayer(shape, 0, 1, device, full_topk=False)
    experts = rowwise_fp8.RowwiseFp8Experts(layer.weights)
    idx, w = torch_native.draw_routing(20, shape["num_experts"], shape["top_k"])
    idx[::3, 1] = -1
    idx[5, :] = -1  # a token routed nowhere: the shared expert alone
    x = data.uniform_std(20, shape["hidden"], std=1.0, device=device)
    reference = layer.reference(x, idx, w)
    for name, (_, combine) in torch_native.FP8_VARIANTS.items():
        y = layer.forward_fp8(x, idx, w, combine, experts)
        error = torch_native_case.errors(y, reference)
        assert torch_native_case.within_tolerance(error, torch_native.FP8_TOLERANCE), (name, error)


def test_fp8_arguments_name_the_problem(tmp_path, capsys):
    with pytest.raises(SystemExit):
        torch_native.parse_args(["measure", "--out", "x.json", "--precision", "fp8", "--ep", "2"])
    assert "--precision fp8: EP 1 only" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        torch_native.parse_args(["measure", "--out", "x.json", "--precision", "fp8",
                                 "--variants", "batched_view"])
    assert "no fp8 variant 'batched_view'" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="--hidden: must be a multiple of 16"):
        smoke(tmp_path, "--preset", "tiny", "--hidden", "264", "--precision", "fp8")
