"""Decode a paged batch of two sequences with every method of the library, beside dense.

    python examples/python/decode_paged.py      (after `pip install .`)

Exact methods (dense, certified, screened) give the same output; topk and gaussian read fewer
bytes and approximate it. kv_fraction = bytes read / K+V bytes of the batch.
"""
import numpy as np

import entmaxkv

HK, D, H = 2, 64, 8  # KV heads, head dim, query heads (GQA 4)
rng = np.random.default_rng(0)
cache = entmaxkv.PagedKVCache(num_pages=256, page_size=16, num_kv_heads=HK, head_dim=D,
                              code_bits=4)  # key codes: the screened method reads them
seqs = []
for n in (2000, 700):  # a ragged batch
    s = cache.new_sequence()
    k = rng.standard_normal((n, HK, D), np.float32)
    k[rng.random(n) < 0.01] += 3 * rng.standard_normal(D, np.float32)  # a few keys stand out
    cache.append(s, k, rng.standard_normal((n, HK, D), np.float32))
    seqs.append(s)
q = rng.standard_normal((len(seqs), H, D), np.float32)

dense = entmaxkv.DecodeWrapper("dense")
dense.plan(cache, seqs, H)
ref = dense.run(q)
for method in ("dense", "certified", "screened", "topk", "gaussian"):
    w = entmaxkv.DecodeWrapper(method, budget=1 / 16)
    w.plan(cache, seqs, H)
    out = w.run(q)
    print(f"{method:10s} max |out - dense| {np.abs(out - ref).max():.2e}  "
          f"kv_fraction {w.report['kv_fraction']:.3f}  "
          f"mean support {w.report['support'].mean():.1f}")
