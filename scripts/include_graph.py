#!/usr/bin/env python3
"""The folder-level include graph of src/, checked against the library's layering.

Prints every folder of src/ with the folders it includes (#include "..." resolved against the
including file's folder, then against src/, as the build's include path does; system and public
headers are not part of the graph), then fails (exit 1) when
  * the folders include each other in a circle, or files do;
  * an arrow goes from a lower layer to a higher one, or between two rooms of one layer;
  * a folder is in no layer.
LAYERS in this script is the layering, top first (docs/architecture.md, "Source layout"). A layer's entry
names a folder and every folder inside it that has no entry of its own (the CPU and CUDA
backends name each of their rooms, so their rooms are layered too).
Usage: scripts/include_graph.py [SRC_DIR]   (default: the src/ beside this script)
"""
import argparse
import os
import re
import sys

LAYERS = [
    ["model"],  # the model engine: every backend, the cache
    # evaluation entry points; the sharded simulation; the CUDA stubs (src/cuda/ itself); the
    # sharded CUDA plan
    ["eval", "cpu/sharded", "cuda", "cuda/sharded"],
    ["cpu/methods", "cuda/plan"],  # the method runners: ekv_decode; the CUDA plan: ekv_cuda_decode
    ["cpu/select", "cuda/screen"],  # the selection policies; the CUDA screen (screened decode)
    # the CPU stages; the paged cache (converts with the kernels); the CUDA stages, selectors,
    # device cache and prefill
    ["cpu/stages", "cache", "cuda/stages", "cuda/select", "cuda/cache", "cuda/prefill"],
    ["cpu/kernels", "cuda/common", "ref"],  # per-ISA kernels; CUDA's shared headers; the reference
    ["core"],  # context, validation, the method table, geometry
    ["math"],  # the math, shared with CUDA: includes nothing of src/
]

INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.M)
SOURCES = (".c", ".h", ".cu", ".cuh")


def entry_of(folder):
    """The layer entry a folder belongs to (the longest entry that is it or a parent), or None."""
    best = None
    for entry in (e for layer in LAYERS for e in layer):
        if folder == entry or folder.startswith(entry + "/"):
            if best is None or len(entry) > len(best):
                best = entry
    return best


def level_of(entry):
    return next(i for i, layer in enumerate(LAYERS) if entry in layer)


def file_graph(src):
    """{file: set of files it includes}, paths relative to src."""
    graph = {}
    for root, _, names in os.walk(src):
        for name in sorted(names):
            if not name.endswith(SOURCES):
                continue
            path = os.path.join(root, name)
            rel = os.path.relpath(path, src)
            with open(path, encoding="utf-8", errors="replace") as f:
                text = f.read()
            targets = set()
            for inc in INCLUDE.findall(text):
                for base in (root, src):
                    cand = os.path.normpath(os.path.join(base, inc))
                    if os.path.isfile(cand) and not os.path.relpath(cand, src).startswith(".."):
                        targets.add(os.path.relpath(cand, src))
                        break
            graph[rel] = targets
    return graph


def circles(graph):
    """The strongly connected components with more than one node (Tarjan, iterative)."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on.add(start)
        while work:
            node, it = work[-1]
            nxt = next(it, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter[0]
                    counter[0] += 1
                    stack.append(nxt)
                    on.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                elif nxt in on:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    v = stack.pop()
                    on.discard(v)
                    comp.append(v)
                    if v == node:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser(description=__doc__.split("\nUsage:")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src", nargs="?", default=os.path.join(here, "..", "src"),
                    help="the source folder (default: the src/ beside this script)")
    src = os.path.abspath(ap.parse_args().src)
    files = file_graph(src)
    if not files:
        print(f"include_graph: no C, CUDA or header files under {src}")
        return 1
    folders = {}
    for f, targets in files.items():
        a = os.path.dirname(f)
        folders.setdefault(a, {})
        for t in targets:
            b = os.path.dirname(t)
            if b != a:
                folders[a].setdefault(b, []).append(f"{f} -> {t}")
    errors = []
    for a in sorted(folders):
        ea = entry_of(a)
        arrows = ", ".join(f"{b} ({len(v)})" for b, v in sorted(folders[a].items()))
        print(f"{a:14} [{'?' if ea is None else level_of(ea)}] -> {arrows or '-'}")
        if ea is None:
            errors.append(f"src/{a} is in no layer (add it to LAYERS in scripts/include_graph.py)")
            continue
        for b, why in sorted(folders[a].items()):
            eb = entry_of(b)
            if eb is None or eb == ea:
                continue
            if level_of(eb) <= level_of(ea):
                kind = "a peer" if level_of(eb) == level_of(ea) else "a higher layer"
                errors.append(f"src/{a} includes {kind}, src/{b}: {why[0]}")
    for comp in circles({a: set(bs) for a, bs in folders.items()}):
        errors.append("folders include each other in a circle: " + ", ".join(comp))
    for comp in circles(files):
        errors.append("files include each other in a circle: " + ", ".join(comp))
    print(f"layers, top first: {' | '.join(' '.join(layer) for layer in LAYERS)}")
    for e in errors:
        print("include_graph: " + e)
    if errors:
        return 1
    n = sum(len(bs) for bs in folders.values())
    print(f"include_graph: {len(folders)} folders, {n} arrows, no circle, every arrow points down")
    return 0


if __name__ == "__main__":
    sys.exit(main())
