"""entmaxkv: exact alpha-entmax attention and support-aware sparse decoding.

The Python layer over the C library (ctypes, no compiled extension): arrays in, arrays out.

    import numpy as np, entmaxkv
    p = entmaxkv.entmax(np.random.randn(4, 100).astype(np.float32), alpha=1.5)

Torch CUDA tensors go through CudaPagedKVCache and DecodeWrapper on the GPU; entmaxkv.ops holds
the torch.library custom ops, entmaxkv.hf the transformers Cache and attention function, and
entmaxkv.hf_lm the shipped model as a transformers model (those need torch / transformers).
See README.md ("Python") and docs/python.md for the API.
"""
from ._lib import EntmaxKVError
from .cache import PagedKVCache
from .cuda_cache import CudaPagedKVCache
from .decode import DecodeWrapper
from .functional import (entmax, entmax15, entmax_attention, entmax_attention_backward,
                         entmax_attention_ohat, sparsemax)

try:
    from importlib.metadata import PackageNotFoundError, version

    __version__ = version("entmaxkv")
except PackageNotFoundError:  # run from a source tree with $ENTMAXKV_LIBRARY
    __version__ = "unknown"



def __getattr__(name):
    """entmaxkv.flash_entmax and flash_entmax_varlen, the torch ops (entmaxkv.flash), imported
    on first use: torch is needed there only."""
    if name in ("flash_entmax", "flash_entmax_varlen"):
        from . import flash
        return getattr(flash, name)
    raise AttributeError(f"module 'entmaxkv' has no attribute {name!r}")


__all__ = ["entmax", "entmax15", "sparsemax", "entmax_attention", "entmax_attention_backward",
           "entmax_attention_ohat",
           "PagedKVCache", "CudaPagedKVCache", "DecodeWrapper",
           "EntmaxKVError", "__version__"]
