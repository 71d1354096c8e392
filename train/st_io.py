"""Minimal safetensors reader and writer on numpy (F16, F32, I32, I64, U8).

Layout (the standard one): 8-byte little-endian header length N, N bytes of JSON header
(padded with spaces to a multiple of 8), then the tensor bytes, little-endian, row-major,
each tensor at its [begin, end) offsets relative to the end of the header. Tensors are
written in name order, contiguous, with no gaps.
"""
if __name__ == "__main__":  # a module, not a command: --help says what it is
    import argparse
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                            epilog="A module imported by the scripts of train/; running it does nothing.").parse_args()
    raise SystemExit(0)

import json
import struct

import numpy as np

_DTYPES = {"F16": np.float16, "F32": np.float32, "I32": np.int32, "I64": np.int64, "U8": np.uint8}
_NAMES = {np.dtype(v).str.lstrip("<>|="): k for k, v in _DTYPES.items()}


def _code(a):
    key = np.dtype(a.dtype).newbyteorder("<").str.lstrip("<>|=")
    if key not in _NAMES:
        raise TypeError("unsupported dtype %s" % a.dtype)
    return _NAMES[key]


def write(path, tensors, metadata=None):
    header = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    blobs = []
    off = 0
    for name in sorted(tensors):
        a = np.ascontiguousarray(tensors[name])
        a = a.astype(a.dtype.newbyteorder("<"), copy=False)
        b = a.tobytes()
        header[name] = {"dtype": _code(a), "shape": list(a.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(header, separators=(",", ":")).encode("utf-8")
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)


def read(path):
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n].decode("utf-8"))
    metadata = header.pop("__metadata__", {})
    base = 8 + n
    out = {}
    for name, info in header.items():
        b, e = info["data_offsets"]
        dt = np.dtype(_DTYPES[info["dtype"]]).newbyteorder("<")
        a = np.frombuffer(data, dtype=dt, count=(e - b) // dt.itemsize, offset=base + b)
        out[name] = a.reshape(info["shape"]).copy()
    return out, metadata
