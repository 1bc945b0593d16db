"""CPU tests of the torch-native baseline (torch_native.py): every variant agrees with the fp32
reference and with the others, forward and training-step gradients, on the tiny preset and on
odd shapes; the per-expert loop that stands in for torch._grouped_mm where a CPU torch lacks it;
EP 2 under torchrun (gloo). Skipped where torch is not installed.

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
import torch_native  # noqa: E402  (after the skip: it imports torch)


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
    native = torch_native.grouped_mm(rows, weight, offs)
    loop = torch_native.grouped_mm(rows, weight, offs, loop=True)
    torch.testing.assert_close(native.float(), loop.float(), rtol=2**-7, atol=2**-7)


def test_unused_slots():
    """Slots of -1 (no expert) add nothing, in every variant."""
    shape = dict(torch_native.PRESETS["tiny"])
    device = torch.device("cpu")
    layer = torch_native.TorchNativeLayer(shape, 0, 1, device, full_topk=False)
    idx, w = torch_native.draw_routing(20, shape["num_experts"], shape["top_k"])
    idx[::3, 1] = -1
    idx[5, :] = -1  # a token routed nowhere: the shared expert alone
    x = torch_native.uniform_std(20, shape["hidden"], std=1.0, device=device)
    reference = layer.reference(x, idx, w)
    for name, (layout, combine) in torch_native.VARIANTS.items():
        layer.weights.to_layout(layout)
        with torch.no_grad():
            y = layer.forward(x, idx, w, combine)
        error = torch_native.errors(y, reference)
        assert torch_native.within_tolerance(error), (name, error)


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
