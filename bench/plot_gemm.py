"""The grouped GEMM benchmark's chart from its results JSON (torch_grouped_mm.py combine's, schema
mok-bench/1): per preset, ms and the fraction of the dense GEMM rate of the same run, mok beside
torch._grouped_mm, each GEMM on each of mok's engines. The chart is bench/report.py's; this is
the GEMM device part's way to draw it from one file.

  python3 bench/plot_gemm.py bench/results/gemm.json bench/results/gemm.png
"""
import argparse
import json

import report  # bench/report.py, beside this script


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", help="the gemm results JSON")
    parser.add_argument("image", help="the PNG to write")
    args = parser.parse_args()
    with open(args.results) as file:
        record = json.load(file)
    report.chart("gemm", record, args.image)


if __name__ == "__main__":
    main()
