"""The C library through ctypes: loading, the struct mirrors, errors, and the checks every
value passes before C sees it.

Every call goes through :meth:`Context.call` (or :func:`check`), which turns a non-zero
``ekv_status`` into an :class:`EntmaxKVError` carrying the library's own message
(``ekv_last_error``). Each Python thread gets its own ``ekv_context`` (the last error and the
worker pool live there), because ctypes releases the GIL while a call runs; a call that goes
through a cache made in another thread holds that cache's context's lock (Context). Every
integer and array passed to C goes through the helpers below (as_int, int_array, c_array,
out_array, Memory), so each rule is written once.
"""
import ctypes
import importlib
import operator
import os
import pathlib
import threading

import numpy as np

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


class AttentionParams(ctypes.Structure):
    _fields_ = [("num_queries", c_int64), ("num_keys", c_int64), ("num_heads", c_int32),
                ("num_kv_heads", c_int32), ("head_dim", c_int32), ("causal", c_int32),
                ("alpha", c_double), ("scale", c_float), ("alibi_slopes", c_void_p)]


class FlashEntmaxArgs(ctypes.Structure):
    _fields_ = [("shape", AttentionParams), ("batch", c_int32), ("q_dtype", c_int),
                ("kv_dtype", c_int), ("out_dtype", c_int), ("block_tokens", c_int64),
                ("q", c_void_p), ("k", c_void_p), ("v", c_void_p), ("out", c_void_p),
                ("tau", c_void_p), ("tau_scheme", c_int32), ("row_cap", c_int32),
                ("ohat", c_void_p)]


class CudaPlanParams(ctypes.Structure):
    _fields_ = [("device", c_int32), ("stream", c_void_p), ("max_batch", c_int32),
                ("num_heads", c_int32), ("num_kv_heads", c_int32), ("head_dim", c_int32),
                ("page_size", c_int32), ("max_pages_per_seq", c_int64),
                ("max_candidates", c_int64), ("tensor_cores", c_int32),
                ("screen_list_bytes", c_int64), ("fused_attend", c_int32),
                ("overlap_launches", c_int32), ("select_part_pages", c_int64),
                ("tau_cluster", c_int32), ("tau_spread_min", c_int64)]


class CudaReport(ctypes.Structure):
    _fields_ = [("tau", c_void_p), ("support", c_void_p), ("pages_round1", c_void_p),
                ("pages_round2", c_void_p), ("v_rows", c_void_p), ("list_pages", c_void_p),
                ("lists_round2", c_int64), ("slow_rows", c_int64), ("launches", c_int32),
                ("survivors", c_int64), ("softmax_one_pass", c_int32),
                ("list_heads", c_void_p), ("superpage_skipped", c_int64),
                ("superpage_boxes", c_int64), ("compacted_rows", c_int64),
                ("score_splits", c_int32)]


class CudaAppendItem(ctypes.Structure):
    _fields_ = [("page", c_int32), ("first_slot", c_int32), ("n_new", c_int32),
                ("reserved", c_int32), ("src_token", c_int64)]


class CudaCacheParams(ctypes.Structure):
    _fields_ = [("device", c_int32), ("num_pages", c_int64), ("page_size", c_int32),
                ("num_kv_heads", c_int32), ("head_dim", c_int32), ("dtype", c_int),
                ("layout", c_int), ("range_dtype", c_int), ("compact_ball", c_int32),
                ("superpage_pages", c_int32), ("code_bits", c_int32)]


_MIRRORS = {"ekv_context_params": ContextParams, "ekv_paged_kv": PagedKV,
            "ekv_page_stats": PageStats, "ekv_page_table": PageTable,
            "ekv_cache_params": CacheParams, "ekv_decode_params": DecodeParams,
            "ekv_decode_info": DecodeInfo, "ekv_select_params": SelectParams,
            "ekv_attention_params": AttentionParams, "ekv_flash_entmax_args": FlashEntmaxArgs,
            "ekv_cuda_plan_params": CudaPlanParams, "ekv_cuda_report": CudaReport,
            "ekv_cuda_append_item": CudaAppendItem, "ekv_cuda_cache_params": CudaCacheParams}


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
        "ekv_attention_default_params": (AttentionParams, []),
        **{f"ekv_entmax_attention_forward{sfx}": (c_int, [c_void_p, P(AttentionParams)]
                                                 + [c_void_p] * 5) for sfx in ("", "_f64")},
        **{f"ekv_entmax_attention_backward{sfx}": (c_int, [c_void_p, P(AttentionParams)]
                                                  + [c_void_p] * 8) for sfx in ("", "_f64")},
        **{f"ekv_entmax_attention_ohat{sfx}": (c_int, [c_void_p, P(AttentionParams)]
                                              + [c_void_p] * 5) for sfx in ("", "_f64")},
        "ekv_cache_default_params": (CacheParams, []),
        "ekv_cache_create": (c_int, [c_void_p, P(CacheParams), P(c_void_p)]),
        "ekv_cache_free": (None, [c_void_p]),
        "ekv_cache_seq_new": (c_int, [c_void_p, P(c_int32)]),
        "ekv_cache_seq_free": (c_int, [c_void_p, c_int32]),
        "ekv_cache_seq_length": (c_int, [c_void_p, c_int32, P(c_int64)]),
        "ekv_cache_seq_version": (c_int, [c_void_p, c_int32, P(ctypes.c_uint64)]),
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
        "ekv_cuda_flash_entmax_workspace": (c_int, [c_void_p, P(FlashEntmaxArgs), P(c_int64),
                                                    P(c_int64)]),
        "ekv_cuda_flash_entmax_forward": (c_int, [c_void_p, P(FlashEntmaxArgs), c_void_p,
                                                  c_int64, c_void_p]),
        "ekv_cuda_flash_entmax_backward": (c_int, [c_void_p, P(FlashEntmaxArgs)] + [c_void_p] * 5
                                           + [c_int64, c_void_p]),
        "ekv_cuda_cache_default_params": (CudaCacheParams, []),
        "ekv_cuda_cache_sizes": (c_int, [c_void_p, P(CudaCacheParams), P(c_int64), P(c_int64)]),
        "ekv_cuda_cache_adopt": (c_int, [c_void_p, P(CudaCacheParams), c_void_p, c_void_p,
                                         c_void_p, P(c_void_p)]),
        "ekv_cuda_cache_free": (None, [c_void_p]),
        "ekv_cuda_cache_view": (c_int, [c_void_p, P(PagedKV), P(PageStats)]),
        "ekv_cuda_cache_append": (c_int, [c_void_p, c_void_p, c_void_p, c_int32, c_void_p,
                                          c_void_p]),
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


class Context:
    """An ekv_context and the lock every call made with it holds. A context runs one call at a
    time (include/entmaxkv/core.h), and a cache keeps the context it was created with, so a
    cache used from another thread than its creator's would find the context busy; the lock
    makes that call wait instead (docs/python.md, "Threads"). The message of a failed call is
    read under the same lock, so no other call can overwrite it first. Freed with the last
    reference (the thread's, and each cache made with it)."""

    def __init__(self):
        ptr = c_void_p()
        st = lib.ekv_context_create(None, ctypes.byref(ptr))
        if st:
            raise EntmaxKVError(st, lib.ekv_status_string(st).decode(), "no context")
        self.ptr, self.lock = ptr, threading.RLock()

    def call(self, fn, *args):
        """fn(*args) (a library call that uses this context) under the lock; a non-zero status
        raises EntmaxKVError with the context's message."""
        with self.lock:
            check(fn(*args), self.ptr)

    def __del__(self):
        if lib is not None and getattr(self, "ptr", None):
            lib.ekv_context_free(self.ptr)


def context():
    """This thread's Context (created on first use, freed with the thread and whatever else
    holds it): each Python thread makes its own calls on its own context."""
    ctx = getattr(_local, "ctx", None)
    if ctx is None:
        ctx = _local.ctx = Context()
    return ctx


def is_torch(x):
    """x is a torch tensor (torch is imported only where the caller already uses it)."""
    return type(x).__module__.split(".")[0] == "torch"


def need_module(name, who, install):
    """Imports the optional module `name`, or raises ModuleNotFoundError saying that `who`
    needs it and how to install it (instead of a bare "No module named ...")."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name != name:  # the module is there but one of its own imports failed
            raise
        raise ModuleNotFoundError(f"entmaxkv: {who} needs {name}, which is not installed: "
                                  f"{install} (docs/python.md)", name=name) from None


def need_torch(who):
    """The torch module, or a ModuleNotFoundError saying that `who` needs it."""
    return need_module("torch", who, "pip install torch, or pip install 'entmaxkv[torch]'")


# Every integer the package passes to the library goes through as_int or int_array, so that a
# value outside the C type is refused instead of wrapped by ctypes or numpy.
_BITS = {32: (-(2**31), 2**31 - 1), 64: (-(2**63), 2**63 - 1)}


def as_int(x, name, bits=32):
    """x as a Python int that fits the library's int{bits}: ints and numpy integers, and
    floats with an integral value; bool, other floats and other types raise TypeError, a
    value out of range ValueError."""
    lo, hi = _BITS[bits]
    if type(x) is int and lo <= x <= hi:  # the common case, first (run() checks each step)
        return x
    if isinstance(x, (bool, np.bool_)):
        raise TypeError(f"entmaxkv: {name}={x!r} is a bool, not an integer")
    if isinstance(x, (float, np.floating)):
        if not np.isfinite(x) or x != int(x):
            raise TypeError(f"entmaxkv: {name}={x!r} is not an integer")
        x = int(x)
    try:
        v = operator.index(x)
    except TypeError:
        raise TypeError(f"entmaxkv: {name} must be an integer; got {type(x).__name__}") from None
    if not lo <= v <= hi:
        raise ValueError(f"entmaxkv: {name}={v} does not fit the library's int{bits} "
                         f"[{lo}, {hi}]")
    return v


def int_array(x, name, bits=32):
    """x (a sequence, numpy array or CPU tensor of integers) as a C-contiguous, aligned int32
    or int64 array, each value checked as as_int checks one (floats must be integral)."""
    a = host_array(x, name)
    dt = np.dtype(np.int32 if bits == 32 else np.int64)
    if a.dtype.kind not in "iuf":  # bool ("b") too
        if a.dtype.kind != "O":
            raise TypeError(f"entmaxkv: {name} must hold integers; got dtype {a.dtype}")
        a = np.array([as_int(v, f"{name}[{i}]", bits) for i, v in enumerate(a.reshape(-1))],
                     dt).reshape(a.shape)
    elif a.size:
        if a.dtype.kind == "f" and not np.all(np.isfinite(a) & (a == np.trunc(a))):
            raise TypeError(f"entmaxkv: {name} holds values that are not integers")
        lo, hi = _BITS[bits]
        amin, amax = a.min(), a.max()
        if not (lo <= amin and amax <= hi):
            bad = amin if not lo <= amin else amax
            raise ValueError(f"entmaxkv: {name} holds {int(bad)}, which does not fit the "
                             f"library's int{bits} [{lo}, {hi}]")
    return c_array(a.astype(dt, copy=False))


def host_array(x, name):
    """A numpy view of x: a numpy array (or array-like) as is, a CPU torch tensor without a
    copy; tensors on another device are refused with a message naming the argument. Pass the
    result through c_array (inputs) or out_array (outputs) before its address goes to C."""
    if is_torch(x):
        if x.device.type != "cpu":
            raise TypeError(f"entmaxkv: {name} is on {x.device}, but this call takes host "
                            "memory (numpy arrays or CPU tensors; CUDA tensors go to a "
                            "CudaPagedKVCache, docs/python.md)")
        return x.detach().numpy()
    return np.asarray(x)


def c_array(a, dtype=None):
    """An input array as the library reads it: C-contiguous and aligned for its dtype (a
    copy when a is not; a numpy array may start at any byte, e.g. a view into a byte buffer,
    and the C code loads whole elements), converted to dtype when one is given."""
    f = a.flags
    if f.c_contiguous and f.aligned and (dtype is None or a.dtype == dtype):
        return a  # the common case, without np.require's cost (run() passes q each step)
    return np.require(a, dtype, ("C_CONTIGUOUS", "ALIGNED"))


def out_array(x, name, shape, dtype, inputs=()):
    """The caller's output array x (numpy, or a CPU tensor) as the numpy array the library
    writes into: never copied, so it must be writable, C-contiguous and aligned, of this shape
    (a tuple) and dtype, and share no memory with the inputs; ValueError/TypeError otherwise."""
    a = host_array(x, name)
    if a.dtype != dtype:
        raise TypeError(f"entmaxkv: {name} must be {np.dtype(dtype)}; got {a.dtype}")
    if a.shape != shape:
        raise ValueError(f"entmaxkv: {name} must be {list(shape)}; got {list(a.shape)}")
    if not a.flags.writeable:
        raise ValueError(f"entmaxkv: {name} is read-only: the result is written into it")
    if not a.flags.c_contiguous or not a.flags.aligned:
        raise ValueError(f"entmaxkv: {name} must be C-contiguous and aligned (it is written in "
                         "place, not copied)")
    for other, oname in inputs:
        if np.may_share_memory(a, other):
            raise ValueError(f"entmaxkv: {name} overlaps {oname}: the result would overwrite "
                             "its own input")
    return a


class Memory:
    """Library memory exported to numpy: an array made from it (and every view of that array)
    holds `owner`, which keeps the memory alive, so a view can outlive the Python object that
    gave it (docs/python.md, PagedKVCache's k and v). Read-only: numpy refuses to make it
    writable."""

    def __init__(self, owner, address, shape, dtype):
        self.owner = owner
        self.__array_interface__ = dict(version=3, shape=tuple(shape), data=(address, True),
                                        typestr=np.dtype(dtype).str)

    def array(self):
        return np.asarray(self)


def check(status, ctx):
    """Raises EntmaxKVError for a failed call (status != 0), with the message of ctx (an
    ekv_context pointer); the caller holds the context's lock (Context.call)."""
    if status:
        msg = lib.ekv_last_error(ctx)
        raise EntmaxKVError(status, lib.ekv_status_string(status).decode(),
                            msg.decode() if msg else "")


STATUS = {"NAN_INPUT": -9, "INVALID_SEQUENCE": -11, "CACHE_FULL": -12,
          "INVALID_ARGUMENT": -13}  # the ekv_status codes the Python side raises itself


def fail(status_name, message):
    """Raises the EntmaxKVError the library would for this status (checks made in Python, as
    the CUDA cache's page bookkeeping, report failures as the C cache does)."""
    st = STATUS[status_name]
    raise EntmaxKVError(st, lib.ekv_status_string(st).decode(), message)
