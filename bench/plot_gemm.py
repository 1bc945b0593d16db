"""Bar chart of a gemm results JSON (schema mok-bench/1): mok vs torch TFLOP/s per case, with the
dense-GEMM rate of the same run as a line.

  python3 bench/plot_gemm.py bench/results/gemm-DATE.json bench/results/gemm-DATE.png
"""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(results_path, image_path):
    data = json.load(open(results_path))
    cases = data["cases"]
    names = [c["name"].replace("gemm-", "") for c in cases]
    mok = [c["useful_tflops"] for c in cases]
    torch_rate = [c.get("baseline_tflops") or 0.0 for c in cases]
    positions = range(len(cases))
    figure, axis = plt.subplots(figsize=(max(8, 0.75 * len(cases)), 5))
    axis.bar([p - 0.2 for p in positions], mok, width=0.4, label="mok")
    axis.bar([p + 0.2 for p in positions], torch_rate, width=0.4, label="torch._grouped_mm")
    dense = cases[0]["dense_gemm_tflops"] if cases else None
    if dense:
        axis.axhline(dense, color="gray", linestyle="--", label=f"dense 8192³ ({dense:.0f})")
    axis.set_xticks(list(positions))
    axis.set_xticklabels(names, rotation=60, ha="right", fontsize=8)
    axis.set_ylabel("useful TFLOP/s (bf16)")
    axis.set_title(f"grouped expert GEMMs, EP2 rank, {data['device']}, {data['commit']}")
    axis.legend()
    figure.tight_layout()
    figure.savefig(image_path, dpi=120)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
