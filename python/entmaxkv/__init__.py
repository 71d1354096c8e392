"""entmaxkv: exact alpha-entmax attention and support-aware sparse decoding.

The Python layer over the C library (ctypes, no compiled extension): arrays in, arrays out.

    import numpy as np, entmaxkv
    p = entmaxkv.entmax(np.random.randn(4, 100).astype(np.float32), alpha=1.5)

See README.md ("Python") and docs/python.md for the API.
"""
from ._lib import EntmaxKVError
from .cache import PagedKVCache
from .cuda_cache import CudaPagedKVCache
from .decode import DecodeWrapper
from .functional import entmax, entmax15, sparsemax

try:
    from importlib.metadata import PackageNotFoundError, version

    __version__ = version("entmaxkv")
except PackageNotFoundError:  # run from a source tree with $ENTMAXKV_LIBRARY
    __version__ = "unknown"

__all__ = ["entmax", "entmax15", "sparsemax", "PagedKVCache", "CudaPagedKVCache", "DecodeWrapper",
           "EntmaxKVError", "__version__"]
