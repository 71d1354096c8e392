#!/usr/bin/env python3
"""The length of every C and CUDA function, checked against the project's limits.

A function's length is the lines from its opening brace's line to its closing brace's line, both
counted. The limits are the project's (issue 29): 100 lines in src/, 150 in tools/. Prints each
function over its limit as `path:line: name: N lines (limit L)` and fails (exit 1) when there is
one; --top N also lists the N longest functions of each folder.

The reader is a brace counter, not a compiler: comments, strings and character literals are
blanked first, preprocessor lines (with their continuations) are skipped, and a brace at file
level opens a function when the text before it ends in a parameter list (a `)`, then perhaps
qualifiers such as const or __attribute__((...))). Blocks of `extern "C"`, namespaces and the
bodies of structs (their member functions) are looked into; enums and initialisers are skipped. A
lambda or a nested block counts toward the function that holds it.
Usage: scripts/check_function_length.py [--top N] [DIR:LIMIT ...]   (default: src:100 tools:150,
       relative to the repository root)
"""
import argparse
import os
import re
import sys

SOURCES = (".c", ".h", ".cu", ".cuh", ".cc", ".cpp", ".hpp")
DEFAULT_LIMITS = [("src", 100), ("tools", 150)]
# Names that take a parenthesised argument but are not the function's own parameter list.
NOT_A_NAME = {"__attribute__", "__launch_bounds__", "__declspec", "alignas", "__align__",
              "noexcept", "throw", "decltype", "__noinline__", "__forceinline__"}
IDENT = re.compile(r"[A-Za-z_~][A-Za-z_0-9:<>~]*$")


def blank_comments_and_literals(text):
    """The text with comments, strings and character literals turned into spaces (newlines
    kept, so that line numbers stay) and preprocessor lines blanked the same way."""
    out, i, n = [], 0, len(text)
    line_start = True
    while i < n:
        c = text[i]
        if line_start and c == "#" or (line_start and c in " \t" and
                                       text[i:].lstrip(" \t").startswith("#")):
            # A directive, with its backslash continuations and any comment inside it.
            j = i
            while j < n:
                if text[j] == "\n" and (j == 0 or text[j - 1] != "\\"):
                    break
                j += 1
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
            continue
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
            continue
        if text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
            continue
        if c in "\"'":
            j = i + 1
            while j < n and text[j] != c and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            j = min(j + 1, n)
            out.append(c + re.sub(r"[^\n]", " ", text[i + 1:j - 1]) + c)
            i = j
            line_start = False
            continue
        out.append(c)
        line_start = c == "\n" or (line_start and c in " \t")
        i += 1
    return "".join(out)


def function_name(header):
    """The name before the parameter list of a function's header, or None when the header does
    not end in one (a struct, an initialiser, a namespace)."""
    # A template's parameter list may hold defaults (`template <bool T = false>`): not an `=`.
    h = re.sub(r"\btemplate\s*<[^<>]*(<[^<>]*>[^<>]*)*>", " ", header).strip()
    if not h or "=" in re.sub(r"operator\s*\S+", "", h.split("(")[0]):
        return None
    if re.match(r"^(typedef\s+)?(struct|union|enum|class)\b[^(]*$", h):
        return None
    # The parenthesised groups at the header's own level, last first.
    groups, depth, start = [], 0, None
    for k, ch in enumerate(h):
        if ch == "(":
            if depth == 0:
                start = k
            depth += 1
        elif ch == ")" and depth > 0:
            depth -= 1
            if depth == 0:
                groups.append((start, k))
    if not groups:
        return None
    tail = h[groups[-1][1] + 1:]
    if re.search(r"[^\s\w()]", re.sub(r"__attribute__\s*\(\(.*\)\)", "", tail)):
        return None
    for start, _ in reversed(groups):
        m = IDENT.search(h[:start].rstrip())
        if m and m.group(0) not in NOT_A_NAME:
            return m.group(0)
    return None


def functions(text):
    """(name, first line, length) of every function in a file's text."""
    clean = blank_comments_and_literals(text)
    found, header_start = [], 0
    scopes = []  # the open blocks that hold functions (extern "C", namespaces, struct bodies)
    depth_in_fn, fn = 0, None
    line = 1
    for k, ch in enumerate(clean):
        if ch == "\n":
            line += 1
            continue
        if fn is not None:
            if ch == "{":
                depth_in_fn += 1
            elif ch == "}":
                depth_in_fn -= 1
                if depth_in_fn == 0:
                    found.append((fn[0], fn[1], line - fn[1] + 1))
                    fn, header_start = None, k + 1
            continue
        if ch in ";":
            header_start = k + 1
        elif ch == "{":
            header = clean[header_start:k]
            if re.search(r'\b(namespace\b[\w\s:]*|extern\s+"\s*")\s*$', header) or (
                    re.search(r"\b(struct|class|union)\b[^=()]*$", header)):
                scopes.append("open")
                header_start = k + 1
                continue
            name = function_name(header)
            if name is None:
                # A struct, an enum or an initialiser: skip to its matching brace.
                fn, depth_in_fn = ("", line), 1
                continue
            fn, depth_in_fn = (name, line), 1
        elif ch == "}":
            if scopes:
                scopes.pop()
            header_start = k + 1
    return [f for f in found if f[0]]


def main():
    root = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    ap = argparse.ArgumentParser(description=__doc__.split("\nUsage:")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dirs", nargs="*", metavar="DIR:LIMIT",
                    help="a folder and its limit in lines (default: src:100 tools:150)")
    ap.add_argument("--top", type=int, default=0, help="also list the N longest of each folder")
    args = ap.parse_args()
    limits = DEFAULT_LIMITS
    if args.dirs:
        limits = []
        for d in args.dirs:
            folder, _, lim = d.rpartition(":")
            if not folder or not lim.isdigit():
                ap.error(f"{d}: expected DIR:LIMIT, e.g. src:100")
            limits.append((folder, int(lim)))
    over = 0
    for folder, limit in limits:
        base = folder if os.path.isabs(folder) else os.path.join(root, folder)
        rows = []
        for dirpath, _, names in os.walk(base):
            for name in sorted(names):
                if name.endswith(SOURCES):
                    path = os.path.join(dirpath, name)
                    with open(path, encoding="utf-8", errors="replace") as f:
                        for fname, first, length in functions(f.read()):
                            rows.append((length, os.path.relpath(path, root), first, fname))
        rows.sort(key=lambda r: (-r[0], r[1], r[2]))
        bad = [r for r in rows if r[0] > limit]
        for length, path, first, fname in bad:
            print(f"{path}:{first}: {fname}: {length} lines (limit {limit})")
        over += len(bad)
        if args.top:
            print(f"-- the {args.top} longest in {folder}/:")
            for length, path, first, fname in rows[:args.top]:
                print(f"   {length:4} {path}:{first} {fname}")
        print(f"check_function_length: {folder}/: {len(rows)} functions, "
              f"{len(bad)} over {limit} lines")
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
