#!/usr/bin/env python3
"""Writes tests/data/min_model_odd_header.safetensors: the smallest valid entmaxkv model
(d_model 2, one layer, 2 heads of dim 1, ffn 2; F16 weights, F32 norms) whose JSON header
has an odd length, so every tensor's data is misaligned. test_hardening loads it (the
alignment test) and it seeds fuzz_model. Usage: make_min_model.py [OUT]"""
import json, random, struct, sys

if len(sys.argv) > 1 and sys.argv[1] in ('-h', '--help'):
    print(__doc__)
    sys.exit(0)
out = sys.argv[1] if len(sys.argv) > 1 else 'tests/data/min_model_odd_header.safetensors'
random.seed(1)
d, H, Hk, hd, f = 2, 2, 1, 1, 2
meta = {'arch': 'entmaxkv-lm-v1', 'positions': 'nape', 'vocab': '256', 'd_model': str(d), 'n_layers': '1',
        'n_heads': str(H), 'n_kv_heads': str(Hk), 'head_dim': str(hd), 'ffn_dim': str(f), 'alpha': '1.5',
        'norm_eps': '1e-05', 'train_ctx': '64', 'tied_embeddings': '1'}
shapes = [('tok_embeddings.weight', [256, d]), ('layers.0.attn_norm.weight', [d]),
          ('layers.0.attn.wq.weight', [H * hd, d]), ('layers.0.attn.wk.weight', [Hk * hd, d]),
          ('layers.0.attn.wv.weight', [Hk * hd, d]), ('layers.0.attn.wo.weight', [d, H * hd]),
          ('layers.0.ffn_norm.weight', [d]), ('layers.0.ffn.w1.weight', [f, d]),
          ('layers.0.ffn.w3.weight', [f, d]), ('layers.0.ffn.w2.weight', [d, f]), ('norm.weight', [d])]
hdr, data = {'__metadata__': meta}, b''
for name, shape in shapes:
    n = shape[0] * (shape[1] if len(shape) > 1 else 1)
    norm = 'norm' in name
    vals = [1.0 if norm else random.uniform(-1, 1) for _ in range(n)]
    b = struct.pack('<%d%s' % (n, 'f' if norm else 'e'), *vals)
    hdr[name] = {'dtype': 'F32' if norm else 'F16', 'shape': shape, 'data_offsets': [len(data), len(data) + len(b)]}
    data += b
h = json.dumps(hdr, separators=(',', ':')).encode()
if len(h) % 2 == 0:
    h += b' '  # the format allows trailing spaces in the header
with open(out, 'wb') as fh:
    fh.write(struct.pack('<Q', len(h)) + h + data)
