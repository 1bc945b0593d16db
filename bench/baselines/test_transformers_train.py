"""transformers_train.py's fallback when a model does not fit the GPU: fewer layers, then a skip
with its reason when even one layer does not fit the baseline, and an error when mok runs out of
memory where the baseline fitted. measure_case is replaced by a stand-in that runs out of memory
where told (no model is built). And --append's merge of a run into an earlier file."""

import json
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import transformers_train as tt  # noqa: E402


def fake_measure(fails):
    """measure_case stand-in: fails maps a layer count to the implementation that runs out of
    memory there (None: while the model is built); other layer counts succeed."""
    def measure_case(run, name, spec, layers, progress=None):
        progress = {} if progress is None else progress
        if layers in fails:
            progress["implementation"] = fails[layers]
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 3.50 GiB.")
        return {"name": name, "layers": layers}
    return measure_case


class FakeRun:
    def free(self):
        pass


def test_fewer_layers_until_one_fits(monkeypatch):
    monkeypatch.setattr(tt, "measure_case", fake_measure({3: None, 2: tt.BASELINE}))
    entry, errors, skipped = tt.measure_with_fallback(FakeRun(), "model", {}, 3)
    assert entry == {"name": "model", "layers": 1, "layers_requested": 3}
    assert errors == [] and skipped is None


def test_mok_out_of_memory_with_more_layers_is_an_error_and_fewer_are_measured(monkeypatch):
    monkeypatch.setattr(tt, "measure_case", fake_measure({2: "mok"}))
    entry, errors, skipped = tt.measure_with_fallback(FakeRun(), "model", {}, 2)
    assert entry == {"name": "model", "layers": 1, "layers_requested": 2}
    assert len(errors) == 1 and "2 layers" in errors[0] and "in mok" in errors[0] and skipped is None


@pytest.mark.parametrize("where", [None, tt.BASELINE])
def test_a_model_the_baseline_cannot_hold_is_skipped_with_its_reason(monkeypatch, where):
    monkeypatch.setattr(tt, "measure_case", fake_measure({2: where, 1: where}))
    entry, errors, skipped = tt.measure_with_fallback(FakeRun(), "model", {}, 2)
    assert entry is None and errors == []
    assert "does not fit this GPU's memory with one layer" in skipped
    assert ("building the model" if where is None else tt.BASELINE) in skipped


def test_mok_out_of_memory_where_the_baseline_fitted_is_an_error(monkeypatch):
    monkeypatch.setattr(tt, "measure_case", fake_measure({1: "mok"}))
    entry, errors, skipped = tt.measure_with_fallback(FakeRun(), "model", {}, 1)
    assert entry is None and skipped is None
    assert len(errors) == 1 and "in mok" in errors[0]


def record(cases, errors=(), skipped=(), commit="new"):
    return {"schema": "mok-bench/2", "benchmark": "transformers-train", "commit": commit,
            "cases": [{"name": name, "commit": commit} for name in cases],
            "errors": list(errors), "skipped": list(skipped)}


def test_append_keeps_other_cases_and_replaces_the_same_name(tmp_path):
    path = tmp_path / "train.json"
    path.write_text(json.dumps(record(["qwen", "deepseek"], errors=["old error"], skipped=["old skip"],
                                      commit="old")))
    merged = tt.appended(str(path), record(["qwen"], skipped=["new skip"]))
    assert merged["commit"] == "new"
    assert [(case["name"], case["commit"]) for case in merged["cases"]] == [("deepseek", "old"), ("qwen", "new")]
    assert merged["errors"] == ["old error"] and merged["skipped"] == ["old skip", "new skip"]


def test_append_without_an_earlier_file_is_the_run_alone(tmp_path):
    run = record(["qwen"])
    assert tt.appended(str(tmp_path / "none.json"), run) == run


def test_append_refuses_another_benchmark(tmp_path):
    path = tmp_path / "layer.json"
    path.write_text(json.dumps({"schema": "mok-bench/2", "benchmark": "layer", "cases": []}))
    with pytest.raises(SystemExit, match="not a transformers-train mok-bench/2 JSON"):
        tt.appended(str(path), record(["qwen"]))
