"""The checks every CUDA call makes on its torch tensors before the C library sees a pointer
(the library cannot check device memory without a synchronisation, include/entmaxkv/cuda.h),
and the caller's current stream, on which every launch goes."""
from ._lib import is_torch


def check_cuda_tensor(x, name, dtype, shape, device, aligned=False):
    """x is a contiguous torch CUDA tensor of this dtype and shape on `device`; raises
    TypeError (kind, device, dtype) or ValueError (shape, contiguity, alignment) naming
    `name`. Nothing is copied or converted: a launch reads x where it is."""
    if not is_torch(x) or x.device.type != "cuda":
        where = x.device if is_torch(x) else type(x).__name__
        raise TypeError(f"entmaxkv: {name} must be a torch CUDA tensor on {device}; got {where}")
    if x.device != device:
        raise TypeError(f"entmaxkv: {name} is on {x.device}, the cache on {device}")
    if x.dtype != dtype:
        raise TypeError(f"entmaxkv: {name} must be {dtype}; got {x.dtype}")
    if shape is not None and tuple(x.shape) != tuple(shape):
        raise ValueError(f"entmaxkv: {name} must be {list(shape)}; got {list(x.shape)}")
    if not x.is_contiguous():
        raise ValueError(f"entmaxkv: {name} must be contiguous (no copy is made)")
    align = 16 if aligned else x.element_size()  # a view may start at any byte of its storage
    if x.data_ptr() % align:
        raise ValueError(f"entmaxkv: {name} must be {align}-byte aligned")
    return x


def overlap(a, b):
    """Contiguous tensors a and b share bytes."""
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


def current_stream(device):
    """The caller's current CUDA stream on `device`, as the cudaStream_t the library takes."""
    import torch

    return torch.cuda.current_stream(device).cuda_stream


def check_current_device(device, who):
    """Kernels launch on the calling thread's current device: it must be the cache's."""
    import torch

    if torch.cuda.current_device() != device.index:
        raise RuntimeError(f"{who}: the current CUDA device is cuda:{torch.cuda.current_device()}"
                           f", the cache is on {device}: call it inside torch.cuda.device({device.index})")


def device_guard(device):
    """A context on `device` that restores the caller's current device after (plan creation
    sets the device, include/entmaxkv/cuda.h)."""
    import torch

    return torch.cuda.device(device)
