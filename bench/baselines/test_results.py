"""Tests of the results path on small made-up fixtures (no GPU, no torch): layer_results.py's
mok-bench/2 record (bf16, and the FP8 entries beside it: forward, training step, backward) and
bench/report.py's choice of the latest results, its Markdown table, its chart and its README
replacement. The fixtures' figures are test data, not measurements.

  python3 -m pytest -q bench/baselines/test_results.py
"""
import json
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
import layer_results  # noqa: E402
import report  # noqa: E402  (bench/report.py)

SHAPE = {"hidden": 256, "intermediate": 128, "shared_intermediate": 128, "num_experts": 16,
         "top_k": 4}


def mok_fixture():
    forward_only = {"name": "tiny-ep1", "preset": "tiny", "ep": 1, "tokens_per_rank": 1000,
                    "routing": "uniform", "mok_ms": 2.0, "buffer_bytes_per_rank": 1_000_000,
                    "fused": True, **SHAPE}
    with_backward = dict(forward_only, name="tiny-ep2", ep=2, fwdbwd_ms=5.0, backward_ms=3.0,
                         backward_buffer_bytes_per_rank=500_000, fwdbwd_chunked_ms=5.5,
                         backward_chunked_ms=3.5, backward_chunked_buffer_bytes_per_rank=200_000,
                         chunked_same_bits=True,
                         clock_mhz={"fwd": 1600.0, "fwdbwd": 1500.0, "bwd": 1500.0},
                         power_w={"fwd": 650.0, "fwdbwd": 700.0, "bwd": 700.0})
    return {"date": "2026-12-01T10:00:00Z", "cases": [forward_only, with_backward]}


def torch_fixture(ep, name):
    def variant(fwd, fwd_train, fwdbwd):
        return {"layout": "out_in", "combine": "batched_view", "check": {"passed": True},
                "fwd_ms": fwd, "fwd_train_ms": fwd_train, "fwdbwd_ms": fwdbwd,
                "bwd_ms": fwdbwd - fwd_train, "peak_memory_gb": {"fwd": 1.5, "fwdbwd": 3.0},
                "clock_mhz": {"fwd": 1400.0, "fwdbwd": 1350.0}, "power_w": {"fwd": 690.0, "fwdbwd": 699.0}}

    failed = {"layout": "in_out", "combine": "batched_view", "check": {"passed": False}}
    data = {"device": "NVIDIA H200", "torch": "2.11", "ep": ep, "power_limit_w": 700.0,
            "cases": {name: {"variants": {"index_add": variant(6.0, 6.5, 16.5),
                                          "batched_view": variant(4.0, 4.2, 12.2),
                                          "batched_view_kn": failed}}}}
    if ep == 1:
        data["dense_gemm_tflops"] = 600.0
        data["dense_gemm"] = {"tflops": 600.0, "ms": 1.83, "clock_mhz": 1500.0, "power_w": 700.0}
    return data


def mok_fp8_fixture():
    """bench_layer --precision fp8's form: the bf16 case fields, mok_ms the FP8 forward."""
    timed = {"name": "tiny-ep1", "preset": "tiny", "ep": 1, "tokens_per_rank": 1000,
             "routing": "uniform", "precision": "fp8", "mok_ms": 1.0, "bf16_forward_ms": 2.0,
             "weight_quantize_ms": 0.5, "buffer_bytes_per_rank": 800_000, "fused": True, **SHAPE}
    no_baseline = dict(timed, name="tiny-ep2", ep=2, mok_ms=1.25, bf16_forward_ms=None)
    return {"date": "2026-12-01T10:00:00Z", "precision": "fp8", "cases": [timed, no_baseline]}


def mok_fp8_training_fixture():
    """bench_layer --precision fp8 --backward 1's form: tiny-ep1 also carries the fp8 training
    step (recompute mode) and backward, and mok's bf16 ones (save mode) beside them."""
    data = mok_fp8_fixture()
    data["cases"][0].update({"fwdbwd_ms": 4.0, "fwdbwd_cached_weights_ms": 3.0,
                             "backward_ms": 2.5, "context": "recompute",
                             "bf16_fwdbwd_ms": 6.0, "bf16_backward_ms": 4.0,
                             "backward_buffer_bytes_per_rank": 300_000,
                             "weight_bytes_per_rank": 2 * (16 * 3 * 128 * 256 + 3 * 256 * 128),
                             "fp8_weight_bytes_per_rank": 250_000, "weight_gradients": "bf16",
                             "backward_phases_ms": {"dgrad": 1.0, "wgrad": 1.5}})
    return data


def torch_fp8_fixture():
    def variant(fwd):
        return {"layout": "out_in", "combine": "batched_view", "check": {"passed": True},
                "fwd_ms": fwd, "peak_memory_gb": {"fwd": 1.25}, "clock_mhz": {"fwd": 1900.0},
                "power_w": {"fwd": 600.0}}

    return {"device": "NVIDIA H200", "torch": "2.11", "ep": 1, "precision": "fp8",
            "power_limit_w": 700.0,
            "dense_gemm_fp8": {"tflops": 1200.0, "ms": 0.92, "clock_mhz": 1700.0, "power_w": 690.0},
            "cases": {"tiny-ep1": {"precision": "fp8", "weight_quantize_ms": 0.8,
                                   "variants": {"fp8_batched_view": variant(3.0),
                                                "fp8_batched_bmm": variant(2.5)}}}}


@pytest.fixture
def torch_paths(tmp_path):
    paths = []
    for ep, name in ((1, "tiny-ep1"), (2, "tiny-ep2")):
        path = tmp_path / f"layer-torch-ep{ep}.json"
        path.write_text(json.dumps(torch_fixture(ep, name)))
        paths.append(str(path))
    fp8_path = tmp_path / "layer-torch-fp8-ep1.json"
    fp8_path.write_text(json.dumps(torch_fp8_fixture()))
    return paths, str(fp8_path)


@pytest.fixture
def layer_record(tmp_path, torch_paths):
    paths, _ = torch_paths
    torch_cases, info = layer_results.load_torch(paths + [str(tmp_path / "missing.json")])
    return layer_results.combine(mok_fixture(), torch_cases, info, "abc123")


def test_layer_record_phases_and_figures(layer_record):
    record = layer_record
    assert record["schema"] == "mok-bench/2" and record["benchmark"] == "layer"
    assert record["dense_gemm_tflops"] == 600.0 and record["date"] == "2026-12-01T10:00:00Z"
    phases = [(e["name"], e["phase"]) for e in record["cases"]]
    # tiny-ep1 has no mok backward: fwd only; its baseline training step goes apart.
    assert phases == [("tiny-ep1", "fwd"), ("tiny-ep2", "fwd"), ("tiny-ep2", "fwdbwd"),
                      ("tiny-ep2", "bwd")]
    assert [(e["name"], e["phase"]) for e in record["baseline_without_mok"]] == [
        ("tiny-ep1", "fwdbwd"), ("tiny-ep1", "bwd")]
    fwd = record["cases"][0]
    assert fwd["baseline"] == "batched_view" and fwd["baseline_ms"] == 4.0
    assert fwd["baseline_variants"] == {"index_add": 6.0, "batched_view": 4.0}  # failed: untimed
    assert fwd["speedup"] == 2.0
    flops = 6 * 1000 * 256 * (4 * 128 + 128)
    assert fwd["useful_tflops"] == round(flops / 2e-3 / 1e12, 2)
    assert fwd["fraction_of_dense"] == round(flops / 2e-3 / 1e12 / 600.0, 4)
    assert fwd["clock_mhz"] == 1400.0 and fwd["power_w"] == 690.0
    # mok's own samples: none for tiny-ep1; tiny-ep2's per phase.
    assert fwd["mok_clock_mhz"] is None and fwd["mok_power_w"] is None
    assert [(e["mok_clock_mhz"], e["mok_power_w"]) for e in record["cases"][1:]] == [
        (1600.0, 650.0), (1500.0, 700.0), (1500.0, 700.0)]
    weights = 2 * (16 * 3 * 128 * 256 + 3 * 256 * 128)
    assert fwd["peak_memory_gb"] == {"mok": round((1_000_000 + weights) / 1e9, 3), "baseline": 1.5}
    fwdbwd, bwd = record["cases"][2], record["cases"][3]
    assert fwdbwd["useful_tflops"] == round(3 * flops / 5e-3 / 1e12, 2)
    assert bwd["useful_tflops"] == round(2 * flops / 3e-3 / 1e12, 2)
    assert bwd["baseline_ms"] == 8.0 and bwd["baseline"] == "batched_view"
    ep2_weights = 2 * (8 * 3 * 128 * 256 + 3 * 256 * 128)
    assert fwdbwd["peak_memory_gb"]["mok"] == round((1_500_000 + ep2_weights) / 1e9, 3)
    assert fwdbwd["clock_mhz"] == 1350.0 and "backward_buffer_bytes_per_rank" in fwdbwd["memory_note"]
    # The low-memory backward beside save mode: its times, its memory (its buffers in place of save
    # mode's backward buffers), its bits; nothing for fwd or where it did not run.
    assert (fwdbwd["mok_low_memory_ms"], bwd["mok_low_memory_ms"]) == (5.5, 3.5)
    assert fwdbwd["mok_low_memory_gb"] == round((1_200_000 + ep2_weights) / 1e9, 3)
    assert fwdbwd["mok_low_memory_same_bits"] is True and bwd["mok_low_memory_same_bits"] is True
    assert record["cases"][1]["mok_low_memory_ms"] is None and record["cases"][1]["mok_low_memory_gb"] is None
    assert record["baseline_checks"]["tiny-ep1"]["batched_view_kn"] == {"passed": False}


def test_fp8_entries_beside_bf16(torch_paths, layer_record):
    paths, fp8_path = torch_paths
    torch_cases, info = layer_results.load_torch(paths)
    fp8 = (mok_fp8_fixture(), *layer_results.load_torch([fp8_path], precision="fp8"))
    record = layer_results.combine(mok_fixture(), torch_cases, info, "abc123", fp8)
    # The bf16 record is unchanged: its entries first, as without --mok-fp8.
    bf16 = [e for e in record["cases"] if e["precision"] == "bf16"]
    assert bf16 == layer_record["cases"] and record["cases"][: len(bf16)] == bf16
    assert record["dense_gemm_tflops"] == 600.0 and record["dense_gemm_fp8_tflops"] == 1200.0
    assert record["baseline_without_mok"] == layer_record["baseline_without_mok"]
    fp8_entries = record["cases"][len(bf16):]
    assert [(e["name"], e["phase"], e["precision"]) for e in fp8_entries] == [
        ("tiny-ep1-fp8", "fwd", "fp8"), ("tiny-ep2-fp8", "fwd", "fp8")]
    entry = fp8_entries[0]
    assert entry["mok_ms"] == 1.0 and entry["baseline"] == "fp8_batched_bmm"
    assert entry["baseline_ms"] == 2.5 and entry["speedup"] == 2.5
    assert entry["baseline_variants"] == {"fp8_batched_view": 3.0, "fp8_batched_bmm": 2.5}
    assert entry["mok_bf16_ms"] == 2.0 and entry["vs_mok_bf16"] == 2.0
    assert entry["mok_weight_quantize_ms"] == 0.5 and entry["baseline_weight_quantize_ms"] == 0.8
    # the fastest torch bf16 forward of the same case, since torch's FP8 is not always faster
    assert entry["baseline_bf16"] == "batched_view" and entry["baseline_bf16_ms"] == 4.0
    assert entry["speedup_vs_baseline_bf16"] == 4.0
    flops = 6 * 1000 * 256 * (4 * 128 + 128)
    assert entry["useful_tflops"] == round(flops / 1e-3 / 1e12, 2)
    assert entry["dense_gemm_tflops"] == 1200.0  # the FP8 rate, not bf16's
    assert entry["fraction_of_dense"] == round(flops / 1e-3 / 1e12 / 1200.0, 4)
    assert entry["clock_mhz"] == 1900.0 and entry["power_w"] == 600.0
    e4m3_weights = 16 * 3 * 128 * 256 + 3 * 256 * 128  # one byte each
    assert entry["peak_memory_gb"] == {"mok": round((800_000 + e4m3_weights) / 1e9, 3), "baseline": 1.25}
    assert "e4m3" in entry["memory_note"]
    assert entry["mok_context"] is None and entry["mok_recompute_ms"] is None
    # EP 2: no torch FP8 run at EP 2, and no bf16 forward from bench_layer
    no_baseline = fp8_entries[1]
    assert no_baseline["baseline"] is None and no_baseline["speedup"] is None
    assert no_baseline["vs_mok_bf16"] is None
    assert record["baseline_checks"]["tiny-ep1-fp8"]["fp8_batched_bmm"] == {"passed": True}
    assert "tiny-ep1" in record["baseline_checks"]


def test_fp8_baseline_without_mok_and_precision_mixups(torch_paths):
    _, fp8_path = torch_paths
    mok_fp8 = mok_fp8_fixture()
    mok_fp8["cases"][0]["mok_ms"] = None  # bench_layer's FP8 case failed
    fp8 = (mok_fp8, *layer_results.load_torch([fp8_path], precision="fp8"))
    record = layer_results.combine(mok_fixture(), {}, {"dense": None, "device": None, "torch": None,
                                                       "power_limit_w": None}, "abc123", fp8)
    assert [e["name"] for e in record["cases"] if e["precision"] == "fp8"] == ["tiny-ep2-fp8"]
    only = [e for e in record["baseline_without_mok"] if e["precision"] == "fp8"]
    assert [(e["name"], e["baseline"], e["baseline_ms"]) for e in only] == [
        ("tiny-ep1-fp8", "fp8_batched_bmm", 2.5)]
    with pytest.raises(SystemExit, match="--torch-fp8 takes it"):
        layer_results.load_torch([fp8_path])
    with pytest.raises(SystemExit, match="expected 'fp8'"):
        layer_results.load_torch(torch_paths[0][:1], precision="fp8")


def test_report_shows_fp8_rows(tmp_path, torch_paths):
    paths, fp8_path = torch_paths
    torch_cases, info = layer_results.load_torch(paths)
    fp8 = (mok_fp8_fixture(), *layer_results.load_torch([fp8_path], precision="fp8"))
    record = layer_results.combine(mok_fixture(), torch_cases, info, "abc123", fp8)
    (tmp_path / "layer.json").write_text(json.dumps(record))
    text = report.report_text(report.latest_results(str(tmp_path), {"layer"}), {}, str(tmp_path))
    rows = [line for line in text.splitlines() if line.startswith("| tiny-ep1")]
    assert rows[-1].startswith("| tiny-ep1-fp8 | fwd | 1.00 ms |")
    assert "2.50 ms (torch-native fp8_batched_bmm) | 2.50× |" in rows[-1]


def test_fp8_training_step_entries(tmp_path, torch_paths):
    paths, fp8_path = torch_paths
    torch_cases, info = layer_results.load_torch(paths)
    fp8_torch = layer_results.load_torch([fp8_path], precision="fp8")
    forward_only = layer_results.combine(mok_fixture(), torch_cases, info, "abc123",
                                         (mok_fp8_fixture(), *fp8_torch))
    record = layer_results.combine(mok_fixture(), torch_cases, info, "abc123",
                                   (mok_fp8_training_fixture(), *fp8_torch))
    fp8 = {(e["name"], e["phase"]): e for e in record["cases"] if e["precision"] == "fp8"}
    assert list(fp8) == [("tiny-ep1-fp8", "fwd"), ("tiny-ep1-fp8", "fwdbwd"),
                         ("tiny-ep1-fp8", "bwd"), ("tiny-ep2-fp8", "fwd")]
    # The forward entries as without the training step (the e4m3 weights in their memory, not
    # the bf16 weight_bytes_per_rank); no baseline-only fp8 phases (torch has no fp8 step).
    assert [e for e in record["cases"] if e["phase"] == "fwd"] == [
        e for e in forward_only["cases"] if e["phase"] == "fwd"]
    assert record["baseline_without_mok"] == forward_only["baseline_without_mok"]
    flops = 6 * 1000 * 256 * (4 * 128 + 128)
    step, backward = fp8[("tiny-ep1-fp8", "fwdbwd")], fp8[("tiny-ep1-fp8", "bwd")]
    for entry in (step, backward):
        assert entry["precision"] == "fp8" and entry["mok_context"] == "recompute"
        assert entry["mok_bf16_context"] == "save" and entry["mok_recompute_ms"] is None
        # no torch-native FP8 training step: no fp8 baseline, torch's bf16 one beside it
        assert entry["baseline"] is None and entry["baseline_ms"] is None
        assert entry["speedup"] is None and entry["baseline_variants"] == {}
        assert entry["baseline_bf16"] == "batched_view"
        assert entry["mok_weight_quantize_ms"] == 0.5 and entry["dense_gemm_tflops"] == 1200.0
    assert step["mok_ms"] == 4.0 and step["mok_bf16_ms"] == 6.0 and step["vs_mok_bf16"] == 1.5
    assert step["baseline_bf16_ms"] == 12.2 and step["speedup_vs_baseline_bf16"] == 3.05
    assert step["useful_tflops"] == round(3 * flops / 4e-3 / 1e12, 2)
    assert step["fraction_of_dense"] == round(3 * flops / 4e-3 / 1e12 / 1200.0, 4)
    bf16_weights = 2 * (16 * 3 * 128 * 256 + 3 * 256 * 128)
    assert step["peak_memory_gb"]["mok"] == round(
        (800_000 + 300_000 + bf16_weights + 250_000) / 1e9, 3)
    assert "fp8_weight_bytes_per_rank" in step["memory_note"]
    # The step on the cached weights beside it (gradient accumulation), on fwdbwd alone.
    assert step["mok_cached_weights_ms"] == 3.0 and step["vs_mok_bf16_cached_weights"] == 2.0
    assert "mok_cached_weights_ms" not in backward
    assert backward["mok_ms"] == 2.5 and backward["vs_mok_bf16"] == 1.6
    assert backward["baseline_bf16_ms"] == 8.0 and backward["speedup_vs_baseline_bf16"] == 3.2
    assert backward["useful_tflops"] == round(2 * flops / 2.5e-3 / 1e12, 2)

    # The README table: the fp8 rows in phase order, torch's bf16 layer as their baseline.
    (tmp_path / "layer.json").write_text(json.dumps(record))
    text = report.report_text(report.latest_results(str(tmp_path), {"layer"}), {}, str(tmp_path))
    rows = [line for line in text.splitlines() if line.startswith("| tiny-ep1-fp8")]
    assert [row.split(" | ")[1] for row in rows] == ["fwd", "fwdbwd", "bwd"]
    assert rows[1].startswith("| tiny-ep1-fp8 | fwdbwd | 4.00 ms |")
    assert "| 12.20 ms (torch-native batched_view, bf16) | 3.05× |" in rows[1]
    assert "| 8.00 ms (torch-native batched_view, bf16) | 3.20× |" in rows[2]

    # A torch-native FP8 training step, where one is timed, is the baseline where it is faster.
    faster = layer_results.fp8_entry(
        mok_fp8_training_fixture()["cases"][0], "fwdbwd", 4.0,
        {"variants": {"fp8_batched_bmm": {"check": {"passed": True}, "fwdbwd_ms": 10.0}}},
        torch_cases[("tiny-ep1", 1)], 1200.0)
    assert (faster["baseline"], faster["baseline_ms"], faster["speedup"]) == ("fp8_batched_bmm", 10.0, 2.5)
    row = report.layer_rows({"cases": [faster]})[0]
    assert (row["baseline"], row["speedup"]) == ("torch-native fp8_batched_bmm", 2.5)


def test_report_chart_fp8_training_rows(tmp_path, torch_paths):
    pytest.importorskip("matplotlib")
    paths, fp8_path = torch_paths
    torch_cases, info = layer_results.load_torch(paths)
    fp8 = (mok_fp8_training_fixture(), *layer_results.load_torch([fp8_path], precision="fp8"))
    record = layer_results.combine(mok_fixture(), torch_cases, info, "abc123", fp8)
    (tmp_path / "layer.json").write_text(json.dumps(record))
    assert report.main(["--results-dir", str(tmp_path), "--no-table"]) == 0
    assert (tmp_path / "layer.png").stat().st_size > 10_000


def test_report_picks_the_latest_and_writes_the_table(tmp_path, layer_record):
    older = dict(layer_record, date="2026-11-01T00:00:00Z", commit="old")
    (tmp_path / "layer-fwd-h200x2-0123456789ab.json").write_text(json.dumps(older))
    (tmp_path / "layer.json").write_text(json.dumps(layer_record))
    (tmp_path / "layer-mok.json").write_text(json.dumps({"date": "2027-01-01", "cases": []}))
    latest = report.latest_results(str(tmp_path), {"layer"})
    assert list(latest) == ["layer"] and latest["layer"][1]["commit"] == "abc123"
    text = report.report_text(latest, {}, str(tmp_path))
    assert "700 W power cap" in text
    assert "commit abc123" in text and "NVIDIA H200" in text and "2026-12-01" in text
    assert "baseline loops sampled at 1350–1400 MHz, 690–699 W; mok's at 1500–1600 MHz, 650–700 W" in text
    lines = [line for line in text.splitlines() if line.startswith("| tiny")]
    assert lines[0] == ("| tiny-ep1 | fwd | 2.00 ms | 0.49 TFLOP/s | 4.00 ms (torch-native batched_view) "
                        "| 2.00× | 0.00 |")
    assert [line.split(" | ")[1] for line in lines] == ["fwd", "fwd", "fwdbwd", "bwd"]


def test_report_readme_markers(tmp_path, layer_record):
    results = tmp_path / "results"
    results.mkdir()
    (results / "layer.json").write_text(json.dumps(layer_record))
    readme = tmp_path / "README.md"
    readme.write_text(f"# mok\n\n{report.BEGIN_MARKER}\nold table\n{report.END_MARKER}\n\nafter\n")
    assert report.main(["--results-dir", str(results), "--no-png", "--no-table",
                        "--readme", str(readme)]) == 0
    content = readme.read_text()
    assert "old table" not in content and "| tiny-ep2 | bwd |" in content
    assert content.startswith("# mok\n\n" + report.BEGIN_MARKER) and content.endswith(
        report.END_MARKER + "\n\nafter\n")
    assert "`results/layer.json`" in content
    unmarked = tmp_path / "OTHER.md"
    unmarked.write_text("no markers\n")
    assert report.main(["--results-dir", str(results), "--no-png", "--no-table",
                        "--readme", str(unmarked)]) == 0
    assert unmarked.read_text() == "no markers\n"


def test_report_chart(tmp_path, layer_record):
    pytest.importorskip("matplotlib")
    (tmp_path / "layer.json").write_text(json.dumps(layer_record))
    assert report.main(["--results-dir", str(tmp_path), "--no-table"]) == 0
    assert (tmp_path / "layer.png").stat().st_size > 10_000


def test_kind_of_old_names():
    assert report.kind_of("x/layer-fwd-h200x2-8aa8ed148919.json", {}) == "layer"
    assert report.kind_of("x/gemm-h200-8aa8ed148919.json", {}) == "gemm"
    assert report.kind_of("x/comm-h200x2.json", {}) == "comm"
    assert report.kind_of("x/gemm-2026-11-29.json", {}) == "gemm"
    assert report.kind_of("x/anything.json", {"benchmark": "layer"}) == "layer"


def test_report_fp8_baseline_is_the_fastest_of_either_precision():
    """An FP8 row's fastest baseline: torch's bf16 layer where it beats torch's FP8 one."""
    entry = {"name": "x-fp8", "phase": "fwd", "mok_ms": 2.0, "baseline": "fp8_batched_bmm",
             "baseline_ms": 8.0, "speedup": 4.0, "baseline_bf16": "batched_bmm", "baseline_bf16_ms": 5.0}
    row = report.layer_rows({"cases": [entry]})[0]
    assert (row["baseline"], row["baseline_ms"], row["speedup"]) == ("torch-native batched_bmm, bf16", 5.0, 2.5)
    faster_fp8 = dict(entry, baseline_ms=4.0, speedup=0.5)
    row = report.layer_rows({"cases": [faster_fp8]})[0]
    assert (row["baseline"], row["baseline_ms"]) == ("torch-native fp8_batched_bmm", 4.0)
