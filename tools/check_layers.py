#!/usr/bin/env python3
"""Prints mok's include graph between folders and checks it against the layers of
docs/ARCHITECTURE.md: no edge from a lower layer to a higher one, no cycle between folders, and
the clients (tools/, bench/, src/torch/) reach the library through include/mok/ only.

    python3 tools/check_layers.py            # the graph, then the violations; exit 1 if any
    python3 tools/check_layers.py --quiet    # the violations only

Every #include "..." of every C++/CUDA file (.hpp .h .cpp .cu .cuh) under include/, src/, tools/,
bench/ and tests/ counts; system includes (<...>) do not. A header is found relative to the
including file's folder or to include/, src/, tests/ (the project's include paths).
"""
import argparse
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
SUFFIXES = {".hpp", ".h", ".cpp", ".cu", ".cuh"}
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)
SEARCH_PATHS = [ROOT / "include", ROOT / "src", ROOT / "tests"]

# Folder -> layer, highest first. A folder may include its own layer's folders only where listed
# in PEERS, and any lower layer.
LAYERS = [
    ("tests", 7),
    ("tools", 6), ("bench", 6), ("src/torch", 6),
    ("src/runtime", 5), ("src/bridge", 5),
    ("src/kernels/megakernel", 4),
    ("src/kernels/gemm", 3),
    ("src/kernels/comm", 2), ("src/kernels/quantize", 2),
    ("src/kernels/ptx", 1),
    ("src/reference", 1),
    ("src/core", 0),
    ("include/mok", 0), ("include/mok/detail", 0),
]
CLIENTS = {"tools", "bench", "src/torch"}
# Clients' files allowed below include/mok, each with its reason.
EXCEPTIONS: dict[str, str] = {}
PUBLIC = {"include/mok", "include/mok/detail"}


def folder_of(path: pathlib.Path) -> str:
    relative = path.relative_to(ROOT).parent.as_posix()
    for name, _ in LAYERS:
        if relative == name or relative.startswith(name + "/"):
            return name
    return relative


def resolve(including: pathlib.Path, name: str):
    for base in [including.parent, *SEARCH_PATHS]:
        candidate = (base / name).resolve()
        if candidate.is_file() and ROOT in candidate.parents:
            return candidate
    return None


def graph():
    edges = {}
    for top in ("include", "src", "tools", "bench", "tests"):
        for path in sorted((ROOT / top).rglob("*")):
            if path.suffix not in SUFFIXES or not path.is_file():
                continue
            for name in INCLUDE.findall(path.read_text(errors="replace")):
                target = resolve(path, name)
                if target is None:
                    continue
                source_folder, target_folder = folder_of(path), folder_of(target)
                if source_folder != target_folder:
                    edges.setdefault((source_folder, target_folder), []).append(
                        f"{path.relative_to(ROOT)} -> {target.relative_to(ROOT)}")
    return edges


def cycles(edges):
    adjacency = {}
    for source, target in edges:
        adjacency.setdefault(source, set()).add(target)
    found = []
    for (source, target) in edges:
        # is there a path back from target to source?
        stack, seen = [target], set()
        while stack:
            node = stack.pop()
            if node == source:
                found.append((source, target))
                break
            if node in seen:
                continue
            seen.add(node)
            stack.extend(adjacency.get(node, ()))
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quiet", action="store_true", help="print the violations only")
    args = parser.parse_args()
    level = dict(LAYERS)
    edges = graph()
    violations = []
    for (source, target), examples in sorted(edges.items()):
        if not args.quiet:
            print(f"{source:24} -> {target:24} ({len(examples)} includes)")
        if source in CLIENTS and target not in PUBLIC:
            unexcused = [e for e in examples if e.split(" -> ")[0] not in EXCEPTIONS]
            if unexcused:
                violations.append(f"client {source} reaches past include/mok into {target}: {unexcused[0]}")
        elif source in level and target in level and level[target] > level[source]:
            violations.append(f"{source} (layer {level[source]}) includes the higher {target} "
                              f"(layer {level[target]}): {examples[0]}")
    for source, target in cycles(edges):
        violations.append(f"folder cycle through {source} -> {target}: {edges[(source, target)][0]}")
    for path, reason in EXCEPTIONS.items():
        print(f"allowed: {path} {reason}")
    print(f"{len(violations)} violation(s)")
    for line in violations:
        print("  " + line)
    return 1 if violations else 0


if __name__ == "__main__":
    sys.exit(main())
