#!/usr/bin/env python3
"""Writes tests/data/min_model_odd_header.safetensors: the smallest valid entmaxkv model
(d_model 2, one layer, 2 heads of dim 1, ffn 2; F16 weights, F32 norms) whose JSON header
has an odd length, so every tensor's data is misaligned. test_hardening loads it (the
alignment test) and it seeds fuzz_model.
Usage: make_min_model.py [--layers N] [--norm X] [OUT]
  --layers N   N layers instead of one (test_model_cli.sh: a model deeper than 256 layers)
  --norm X     every element of the final norm.weight X instead of 1 (test_model_cli.sh: huge
               finite weights, logits that overflow)"""
import json, random, struct, sys

args = sys.argv[1:]
if args and args[0] in ('-h', '--help'):
    print(__doc__)
    sys.exit(0)
layers, final_norm = 1, 1.0
while args and args[0] in ('--layers', '--norm') and len(args) > 1:
    if args[0] == '--layers':
        layers = int(args[1])
    else:
        final_norm = float(args[1])
    args = args[2:]
out = args[0] if args else 'tests/data/min_model_odd_header.safetensors'
random.seed(1)
d, H, Hk, hd, f = 2, 2, 1, 1, 2
meta = {'arch': 'entmaxkv-lm-v1', 'positions': 'nape', 'vocab': '256', 'd_model': str(d), 'n_layers': str(layers),
        'n_heads': str(H), 'n_kv_heads': str(Hk), 'head_dim': str(hd), 'ffn_dim': str(f), 'alpha': '1.5',
        'norm_eps': '1e-05', 'train_ctx': '64', 'tied_embeddings': '1'}
shapes = [('tok_embeddings.weight', [256, d])]
for l in range(layers):
    shapes += [('layers.%d.attn_norm.weight' % l, [d]), ('layers.%d.attn.wq.weight' % l, [H * hd, d]),
               ('layers.%d.attn.wk.weight' % l, [Hk * hd, d]), ('layers.%d.attn.wv.weight' % l, [Hk * hd, d]),
               ('layers.%d.attn.wo.weight' % l, [d, H * hd]), ('layers.%d.ffn_norm.weight' % l, [d]),
               ('layers.%d.ffn.w1.weight' % l, [f, d]), ('layers.%d.ffn.w3.weight' % l, [f, d]),
               ('layers.%d.ffn.w2.weight' % l, [d, f])]
shapes.append(('norm.weight', [d]))
hdr, data = {'__metadata__': meta}, b''
for name, shape in shapes:
    n = shape[0] * (shape[1] if len(shape) > 1 else 1)
    norm = 'norm' in name
    vals = [(final_norm if name == 'norm.weight' else 1.0) if norm else random.uniform(-1, 1) for _ in range(n)]
    b = struct.pack('<%d%s' % (n, 'f' if norm else 'e'), *vals)
    hdr[name] = {'dtype': 'F32' if norm else 'F16', 'shape': shape, 'data_offsets': [len(data), len(data) + len(b)]}
    data += b
h = json.dumps(hdr, separators=(',', ':')).encode()
if len(h) % 2 == 0:
    h += b' '  # the format allows trailing spaces in the header
with open(out, 'wb') as fh:
    fh.write(struct.pack('<Q', len(h)) + h + data)
