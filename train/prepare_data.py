#!/usr/bin/env python3
"""Build the training and validation text of the entmaxkv language model.

Sources (Debian 12 packages, installed by train/get_data.sh):
  * python3.11-doc: the Python 3.11 documentation, HTML in /usr/share/doc/python3.11/html.
    Each page is one document; only the Sphinx main body (<div class="body" role="main">)
    is kept, converted to plain text with html.parser (no extra dependencies).
  * bible-kjv-text (read through the `bible` program of bible-kjv): the King James Bible.
    Each chapter is one document.

Every document is assigned to the validation split when the first 8 bytes of
sha256("entmaxkv-split-v1:" + document id), read as a big-endian integer, modulo 1000
are below VAL_PERMILLE (50, i.e. about 5 %), else to the training split. The split depends
only on the document id, so it is fixed whatever else changes. Documents are written in
id order, separated by "\n\n" (MODEL.md); inside a document there is never an empty line.

Usage: python3 train/prepare_data.py [--out data] [--html DIR] [--bible PROGRAM]
"""
import argparse
import gzip
import hashlib
import html.parser
import json
import os
import re
import subprocess
import sys

VAL_PERMILLE = 50
SPLIT_SALT = "entmaxkv-split-v1:"

BLOCK_TAGS = {
    "p", "div", "section", "h1", "h2", "h3", "h4", "h5", "h6", "li", "dt", "dd", "dl",
    "ul", "ol", "table", "tr", "pre", "blockquote", "br", "hr", "figure", "figcaption",
    "caption", "thead", "tbody", "aside", "nav",
}
SKIP_TAGS = {"script", "style", "head", "title", "form", "svg", "button"}
VOID_TAGS = {"br", "hr", "img", "input", "meta", "link", "area", "base", "col", "embed",
             "source", "track", "wbr", "param"}


class SphinxText(html.parser.HTMLParser):
    """Collects the text of <div class="body" role="main"> of a Sphinx page."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.depth = 0          # nesting depth inside the main body div (0: outside)
        self.skip = 0           # > 0 inside a skipped element
        self.skip_stack = []    # tag names that opened a skipped element
        self.pre = 0
        self.parts = []
        self.done = False

    def _newline(self):
        self.parts.append("\n")

    def handle_starttag(self, tag, attrs):
        if self.done:
            return
        a = dict(attrs)
        if self.depth == 0:
            if tag == "div" and a.get("role") == "main":
                self.depth = 1
            return
        if tag not in VOID_TAGS:
            self.depth += 1 if tag == "div" else 0
        if self.skip:
            if tag not in VOID_TAGS:
                self.skip_stack.append(tag)
            return
        cls = a.get("class") or ""
        if tag in SKIP_TAGS or (tag == "a" and "headerlink" in cls):
            if tag not in VOID_TAGS:
                self.skip = 1
                self.skip_stack = [tag]
            return
        if tag == "pre":
            self.pre += 1
        if tag in BLOCK_TAGS:
            self._newline()
        if tag == "td" or tag == "th":
            self.parts.append(" ")

    def handle_endtag(self, tag):
        if self.done or self.depth == 0:
            return
        if self.skip:
            if self.skip_stack and self.skip_stack[-1] == tag:
                self.skip_stack.pop()
            if not self.skip_stack:
                self.skip = 0
            if tag == "div":
                self.depth -= 1
            return
        if tag == "pre" and self.pre:
            self.pre -= 1
        if tag in BLOCK_TAGS:
            self._newline()
        if tag == "div":
            self.depth -= 1
            if self.depth == 0:
                self.done = True

    def handle_data(self, data):
        if self.done or self.depth == 0 or self.skip:
            return
        if self.pre:
            self.parts.append(data.replace("\r", ""))
        else:
            self.parts.append(re.sub(r"\s+", " ", data))


def clean_lines(text):
    """Strip trailing spaces, drop empty lines (documents are separated by empty lines)."""
    out = []
    for line in text.split("\n"):
        line = line.rstrip()
        if line.strip() == "":
            continue
        if not line[:1].isspace():
            line = line.lstrip()
        out.append(line)
    return "\n".join(out)


def python_docs(root):
    docs = []
    skip_names = re.compile(r"^(genindex.*|search|py-modindex|contents|index|download)\.html$")
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("_"))
        for name in sorted(filenames):
            if not name.endswith(".html"):
                continue
            rel = os.path.relpath(os.path.join(dirpath, name), root)
            if skip_names.match(rel):
                continue
            with open(os.path.join(dirpath, name), encoding="utf-8") as f:
                p = SphinxText()
                p.feed(f.read())
                p.close()
            text = clean_lines("".join(p.parts))
            if len(text) < 200:
                continue
            docs.append(("python/" + rel, text))
    return docs


def bible_chapters(program):
    raw = subprocess.run([program, "-f", "Gen1:1-Rev22:21"], stdin=subprocess.DEVNULL,
                         capture_output=True, check=True).stdout.decode("utf-8")
    verse = re.compile(r"^([1-3]?[A-Za-z]+)(\d+):(\d+) (.*)$")
    chapters = {}
    order = []
    for line in raw.split("\n"):
        line = line.strip()
        if not line:
            continue
        m = verse.match(line)
        if not m:
            raise SystemExit("unexpected line from %s: %r" % (program, line[:80]))
        book, ch, v, text = m.group(1), int(m.group(2)), int(m.group(3)), m.group(4)
        key = (book, ch)
        if key not in chapters:
            chapters[key] = []
            order.append(key)
        chapters[key].append("%d:%d %s" % (ch, v, text.strip()))
    if len(order) != 1189:
        raise SystemExit("expected 1189 chapters of the KJV, got %d" % len(order))
    docs = []
    for i, (book, ch) in enumerate(order):
        title = "%s %d" % (book, ch)
        docs.append(("kjv/%04d-%s-%d" % (i, book, ch), title + "\n" + "\n".join(chapters[(book, ch)])))
    return docs


def is_val(doc_id):
    h = hashlib.sha256((SPLIT_SALT + doc_id).encode("utf-8")).digest()
    return int.from_bytes(h[:8], "big") % 1000 < VAL_PERMILLE


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="data")
    ap.add_argument("--html", default="/usr/share/doc/python3.11/html")
    ap.add_argument("--bible", default="/usr/bin/bible")
    args = ap.parse_args()

    docs = python_docs(args.html) + bible_chapters(args.bible)
    docs.sort(key=lambda d: d[0])
    split = {"train": [], "val": []}
    for doc_id, text in docs:
        assert "\n\n" not in text
        split["val" if is_val(doc_id) else "train"].append((doc_id, text))

    os.makedirs(args.out, exist_ok=True)
    stats = {}
    for name, items in split.items():
        blob = "\n\n".join(t for _, t in items).encode("utf-8")
        with open(os.path.join(args.out, name + ".txt"), "wb") as f:
            f.write(blob)
        with gzip.GzipFile(os.path.join(args.out, name + ".txt.gz"), "wb", mtime=0) as f:
            f.write(blob)
        with open(os.path.join(args.out, name + "_docs.txt"), "w") as f:
            f.write("\n".join(d for d, _ in items) + "\n")
        src = {}
        for d, t in items:
            s = d.split("/")[0]
            c = src.setdefault(s, [0, 0])
            c[0] += 1
            c[1] += len(t.encode("utf-8"))
        stats[name] = {"bytes": len(blob), "documents": len(items),
                       "sha256": hashlib.sha256(blob).hexdigest(),
                       "by_source": {k: {"documents": v[0], "bytes": v[1]} for k, v in sorted(src.items())}}
    with open(os.path.join(args.out, "stats.json"), "w") as f:
        json.dump(stats, f, indent=1)
    json.dump(stats, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
