"""The C library through ctypes: loading, the struct mirrors, errors.

Every call goes through :func:`check`, which turns a non-zero ``ekv_status`` into an
:class:`EntmaxKVError` carrying the library's own message (``ekv_last_error``). Each Python
thread gets its own ``ekv_context`` (the last error and the worker pool live there), because
ctypes releases the GIL while a call runs.
"""
import ctypes
import os
import pathlib
import threading

c_int32, c_int64, c_double, c_float = ctypes.c_int32, ctypes.c_int64, ctypes.c_double, ctypes.c_float
c_void_p, c_char_p, c_int = ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int
P = ctypes.POINTER

DTYPES = {"float32": 0, "float16": 1, "bfloat16": 2}  # ekv_dtype
LAYOUTS = {"HND": 0, "NHD": 1}  # ekv_kv_layout
METHODS = {"dense": 0, "topk": 1, "gaussian": 3, "certified": 4, "screened": 5}  # ekv_select_method


class EntmaxKVError(RuntimeError):
    """A call into the C library failed: ``status`` is its ``ekv_status`` code (negative),
    ``status_name`` its name, and the message is the library's ``ekv_last_error``."""

    def __init__(self, status, status_name, message):
        super().__init__(f"{status_name}: {message}" if message else status_name)
        self.status = status
        self.status_name = status_name


class ContextParams(ctypes.Structure):
    _fields_ = [("n_threads", c_int32), ("isa", c_int)]


class PagedKV(ctypes.Structure):
    _fields_ = [("k", c_void_p), ("v", c_void_p), ("dtype", c_int), ("page_size", c_int32),
                ("num_kv_heads", c_int32), ("head_dim", c_int32), ("num_pages", c_int64),
                ("stride_page", c_int64), ("stride_head", c_int64), ("stride_token", c_int64)]


class PageStats(ctypes.Structure):
    _fields_ = [("kmin", c_void_p), ("kmax", c_void_p), ("kmean", c_void_p), ("km2", c_void_p),
                ("radius", c_void_p), ("count", c_void_p), ("superpage_pages", c_int32),
                ("smin", c_void_p), ("smax", c_void_p), ("codes", c_void_p),
                ("code_bits", c_int32), ("num_superpages", c_int64), ("range_dtype", c_int),
                ("kmin16", c_void_p), ("kmax16", c_void_p),
                ("kmean16", c_void_p), ("radius16", c_void_p), ("num_pages", c_int64),
                ("num_kv_heads", c_int32), ("head_dim", c_int32), ("page_size", c_int32)]


class PageTable(ctypes.Structure):
    _fields_ = [("batch", c_int32), ("indptr", c_void_p), ("indices", c_void_p),
                ("last_page_len", c_void_p)]


class CacheParams(ctypes.Structure):
    _fields_ = [("num_pages", c_int64), ("page_size", c_int32), ("num_kv_heads", c_int32),
                ("head_dim", c_int32), ("dtype", c_int), ("max_seqs", c_int32),
                ("superpage_pages", c_int32), ("code_bits", c_int32), ("range_dtype", c_int),
                ("layout", c_int), ("k_pool", c_void_p), ("v_pool", c_void_p)]


class DecodeParams(ctypes.Structure):
    _fields_ = [("num_heads", c_int32), ("alpha", c_double), ("scale", c_float),
                ("alibi_slopes", c_void_p)]


class DecodeInfo(ctypes.Structure):
    _fields_ = [("tau", c_void_p), ("support", c_void_p), ("bytes_k", c_int64),
                ("bytes_v", c_int64), ("bytes_summary", c_int64), ("survivors", c_int64),
                ("pages_touched", c_int64), ("lists_round2", c_int64),
                ("pages_round1", c_void_p), ("pages_round2", c_void_p)]


class SelectParams(ctypes.Structure):
    _fields_ = [("method", c_int), ("budget_tokens", c_int64), ("budget_fraction", c_double),
                ("per_query_head", c_int32), ("margin_z", c_double), ("max_quantile", c_double),
                ("auto_margin", c_int32), ("reference_m3", c_int32),
                ("excess_fraction", c_double), ("clamp_tau", c_int32),
                ("clamp_quantile", c_double), ("tau_mode", c_int), ("correction_iters", c_int32),
                ("use_ball", c_int32), ("sink_pages", c_int32), ("recent_pages", c_int32),
                ("tau_lb", c_void_p), ("tau_hint", c_void_p)]


class CudaPlanParams(ctypes.Structure):
    _fields_ = [("device", c_int32), ("stream", c_void_p), ("max_batch", c_int32),
                ("num_heads", c_int32), ("num_kv_heads", c_int32), ("head_dim", c_int32),
                ("page_size", c_int32), ("max_pages_per_seq", c_int64),
                ("max_candidates", c_int64), ("tensor_cores", c_int32)]


class CudaReport(ctypes.Structure):
    _fields_ = [("tau", c_void_p), ("support", c_void_p), ("pages_round1", c_void_p),
                ("pages_round2", c_void_p), ("v_rows", c_void_p), ("list_pages", c_void_p),
                ("lists_round2", c_int64), ("slow_rows", c_int64), ("launches", c_int32),
                ("survivors", c_int64), ("softmax_one_pass", c_int32),
                ("list_heads", c_void_p), ("superpage_skipped", c_int64),
                ("superpage_boxes", c_int64), ("compacted_rows", c_int64)]


class CudaAppendItem(ctypes.Structure):
    _fields_ = [("page", c_int32), ("first_slot", c_int32), ("n_new", c_int32),
                ("reserved", c_int32), ("src_token", c_int64)]


_MIRRORS = {"ekv_context_params": ContextParams, "ekv_paged_kv": PagedKV,
            "ekv_page_stats": PageStats, "ekv_page_table": PageTable,
            "ekv_cache_params": CacheParams, "ekv_decode_params": DecodeParams,
            "ekv_decode_info": DecodeInfo, "ekv_select_params": SelectParams,
            "ekv_cuda_plan_params": CudaPlanParams, "ekv_cuda_report": CudaReport,
            "ekv_cuda_append_item": CudaAppendItem}


def _library_path():
    """$ENTMAXKV_LIBRARY, else the shared library installed inside this package."""
    env = os.environ.get("ENTMAXKV_LIBRARY")
    if env:
        return env
    here = pathlib.Path(__file__).resolve().parent
    for name in ("libentmaxkv.so", "libentmaxkv.dylib", "entmaxkv.dll"):
        if (here / name).exists():
            return str(here / name)
    raise ImportError(f"entmaxkv: the C library is not in {here} (install the package with "
                      "'pip install .', or point $ENTMAXKV_LIBRARY at libentmaxkv.so)")


def _declare(lib):
    sigs = {
        "ekv_status_string": (c_char_p, [c_int]),
        "ekv_last_error": (c_char_p, [c_void_p]),
        "ekv_abi_sizeof": (c_int64, [c_char_p]),
        "ekv_context_create": (c_int, [c_void_p, P(c_void_p)]),
        "ekv_context_free": (None, [c_void_p]),
        "ekv_entmax_rows": (c_int, [c_void_p, c_void_p, c_int64, c_int64, c_double, c_void_p]),
        "ekv_entmax_rows_f64": (c_int, [c_void_p, c_void_p, c_int64, c_int64, c_double,
                                        c_void_p]),
        "ekv_cache_default_params": (CacheParams, []),
        "ekv_cache_create": (c_int, [c_void_p, P(CacheParams), P(c_void_p)]),
        "ekv_cache_free": (None, [c_void_p]),
        "ekv_cache_seq_new": (c_int, [c_void_p, P(c_int32)]),
        "ekv_cache_seq_free": (c_int, [c_void_p, c_int32]),
        "ekv_cache_seq_length": (c_int, [c_void_p, c_int32, P(c_int64)]),
        "ekv_cache_free_pages": (c_int64, [c_void_p]),
        "ekv_cache_seq_adopt": (c_int, [c_void_p, c_int32, c_void_p, c_int64, c_int32]),
        "ekv_cache_append": (c_int, [c_void_p, c_int32, c_int64, c_void_p, c_void_p, c_int]),
        "ekv_cache_kv_view": (c_int, [c_void_p, P(PagedKV), P(PageStats)]),
        "ekv_cache_page_table": (c_int, [c_void_p, c_void_p, c_int32, c_void_p, c_void_p,
                                         c_int64, c_void_p, P(c_int64)]),
        "ekv_cache_compact_ranges": (c_int, [c_int]),
        "ekv_dtype_size": (c_int64, [c_int]),
        "ekv_decode_default_params": (DecodeParams, []),
        "ekv_select_default_params": (SelectParams, []),
        "ekv_decode": (c_int, [c_void_p, P(DecodeParams), P(SelectParams), P(PagedKV),
                               P(PageStats), P(PageTable), c_void_p, c_void_p, P(DecodeInfo)]),
        # the CUDA API (include/entmaxkv/cuda.h); a build without CUDA answers UNSUPPORTED
        "ekv_cuda_plan_default_params": (CudaPlanParams, []),
        "ekv_cuda_device_count": (c_int, [c_void_p, P(c_int32)]),
        "ekv_cuda_plan_create": (c_int, [c_void_p, P(CudaPlanParams), P(c_void_p)]),
        "ekv_cuda_plan_free": (None, [c_void_p]),
        "ekv_cuda_plan_bytes": (c_int64, [c_void_p]),
        "ekv_cuda_decode": (c_int, [c_void_p, P(DecodeParams), P(SelectParams), P(PagedKV),
                                    P(PageStats), P(PageTable), c_void_p, c_void_p]),
        "ekv_cuda_decode_certified": (c_int, [c_void_p, P(DecodeParams), P(SelectParams),
                                              P(PagedKV), P(PageStats), P(PageTable), c_void_p,
                                              c_void_p]),
        "ekv_cuda_read_report": (c_int, [c_void_p, c_int32, P(CudaReport)]),
        "ekv_cuda_append": (c_int, [c_void_p, P(PagedKV), P(PageStats), c_void_p, c_int32,
                                    c_void_p, c_void_p]),
    }
    for name, (res, args) in sigs.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = res, args
    for cname, mirror in _MIRRORS.items():  # a mirror that drifted from the header is a bug
        size = lib.ekv_abi_sizeof(cname.encode())
        if size != ctypes.sizeof(mirror):
            raise ImportError(f"entmaxkv: {cname} is {size} bytes in the library but "
                              f"{ctypes.sizeof(mirror)} in the Python mirror: a version mismatch")
    return lib


lib = _declare(ctypes.CDLL(_library_path()))
_local = threading.local()


def context():
    """This thread's ekv_context (created on first use, freed with the thread)."""
    return context_holder().ctx


def context_holder():
    """This thread's context holder: an object that owns the ekv_context (`.ctx`) and frees
    it when the last reference goes; a cache keeps it, since the cache reports its errors
    into, and runs its appends on, the context it was created with."""
    ctx = getattr(_local, "ctx", None)
    if ctx is None:
        ctx = c_void_p()
        st = lib.ekv_context_create(None, ctypes.byref(ctx))
        if st:
            raise EntmaxKVError(st, lib.ekv_status_string(st).decode(), "no context")
        _local.ctx = ctx
        _local.keeper = _ContextKeeper(ctx)
    return _local.keeper


class _ContextKeeper:
    def __init__(self, ctx):
        self.ctx = ctx

    def __del__(self):
        if lib is not None and self.ctx:
            lib.ekv_context_free(self.ctx)


def is_torch(x):
    """x is a torch tensor (torch is imported only where the caller already uses it)."""
    return type(x).__module__.split(".")[0] == "torch"


def host_array(x, name):
    """A numpy view of x: a numpy array (or array-like) as is, a CPU torch tensor without a
    copy; tensors on another device are refused with a message naming the argument."""
    if is_torch(x):
        if x.device.type != "cpu":
            raise TypeError(f"entmaxkv: {name} is on {x.device}, but this call takes host "
                            "memory (numpy arrays or CPU tensors; CUDA tensors go to a "
                            "CudaPagedKVCache, docs/python.md)")
        return x.detach().numpy()
    import numpy as np

    return np.asarray(x)


def check(status, ctx=None):
    """Raises EntmaxKVError for a failed call (status != 0), with the context's message."""
    if status:
        msg = lib.ekv_last_error(ctx if ctx is not None else context())
        raise EntmaxKVError(status, lib.ekv_status_string(status).decode(),
                            msg.decode() if msg else "")


STATUS = {"NAN_INPUT": -9, "INVALID_SEQUENCE": -11, "CACHE_FULL": -12,
          "INVALID_ARGUMENT": -13}  # the ekv_status codes the Python side raises itself


def fail(status_name, message):
    """Raises the EntmaxKVError the library would for this status (checks made in Python, as
    the CUDA cache's page bookkeeping, report failures as the C cache does)."""
    st = STATUS[status_name]
    raise EntmaxKVError(st, lib.ekv_status_string(st).decode(), message)
