#!/usr/bin/env python3
"""Every CUDA kernel of the library begins with ekv_grid_begin() (src/cuda/common/overlap.cuh),
or with ekv_grid_begin_with(...), whose reads touch only memory no kernel writes.

A kernel launched with overlap (programmatic dependent launch) may start while the kernel before
it still runs; it is exact only if it waits for that kernel before its first global access, and
ekv_grid_begin() is that wait. Any kernel may be launched so, so the rule is every kernel's: the
first statement of each __global__ function's body is the call. Prints each kernel that breaks it
as `path:line: name` and fails (exit 1) when there is one.

The reader is a brace counter (comments and literals blanked first), not a compiler.
Usage: scripts/check_kernels.py [DIR ...]   (default: src, relative to the repository root)
"""
import argparse
import os
import re
import sys

SOURCES = (".cu", ".cuh")
KERNEL = re.compile(r"\b__global__\b")
# ekv_grid_begin(); or [const T x =] ekv_grid_begin_with(<reads of memory no kernel writes>);
FIRST = re.compile(r"\s*(ekv_grid_begin\s*\(\s*\)\s*;|"
                   r"(?:(?:const\s+)?[A-Za-z_][\w:<>]*\s+[A-Za-z_]\w*\s*=\s*)?"
                   r"ekv_grid_begin_with\s*\()")


def blank(text):
    """Comments and string/character literals as spaces, newlines kept."""
    out, i, n = [], 0, len(text)
    while i < n:
        two = text[i:i + 2]
        if two == "//":
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
        elif two == "/*":
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif text[i] in "\"'":
            q, j = text[i], i + 1
            while j < n and text[j] != q:
                j += 2 if text[j] == "\\" else 1
            out.append(" " * (min(j + 1, n) - i))
            i = j + 1
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


def body_start(text, at):
    """The index just past the `{` that opens the function declared at `at`: the first brace
    after the parameter list's closing parenthesis at depth 0. None for a declaration."""
    depth, i, seen_params = 0, at, False
    while i < len(text):
        c = text[i]
        if c == "(":
            depth += 1
        elif c == ")":
            depth -= 1
            seen_params = seen_params or depth == 0
        elif c == ";" and depth == 0:
            return None
        elif c == "{" and depth == 0 and seen_params:
            return i + 1
        i += 1
    return None


def kernel_name(text, at, start):
    """The identifier before the parameter list of the kernel declared at `at`."""
    head = text[at:start]
    names = re.findall(r"([A-Za-z_][A-Za-z_0-9]*)\s*\(", head)
    skip = {"__launch_bounds__", "__global__"}
    names = [x for x in names if x not in skip]
    return names[0] if names else "?"


def check_file(path):
    with open(path, encoding="utf-8") as f:
        text = blank(f.read())
    bad = []
    for m in KERNEL.finditer(text):
        start = body_start(text, m.end())
        if start is None:
            continue
        if not FIRST.match(text, start):
            line = text.count("\n", 0, m.start()) + 1
            bad.append(f"{path}:{line}: {kernel_name(text, m.end(), start)}")
    return bad


def main():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ap = argparse.ArgumentParser(description="Every CUDA kernel's first statement is "
                                 "ekv_grid_begin() (src/cuda/common/overlap.cuh).")
    ap.add_argument("dirs", nargs="*", default=[os.path.join(root, "src")],
                    help="folders to read (default: the repository's src)")
    args = ap.parse_args()
    bad, kernels = [], 0
    for d in args.dirs:
        for base, _, files in os.walk(d):
            for name in sorted(files):
                if name.endswith(SOURCES):
                    path = os.path.join(base, name)
                    bad += check_file(path)
                    with open(path, encoding="utf-8") as f:
                        kernels += len(KERNEL.findall(blank(f.read())))
    for b in bad:
        print(f"{b}: the kernel's first statement must be ekv_grid_begin(); "
              "(src/cuda/common/overlap.cuh)")
    if kernels == 0:
        print("check_kernels: no kernel found: wrong folder?")
        return 1
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
