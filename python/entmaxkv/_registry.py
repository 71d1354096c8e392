"""Every DecodeWrapper by its handle, the int the custom ops (entmaxkv.ops) name it by. A module
of its own: decode.py registers each wrapper and ops.py looks them up, so both import this one
and ops.py does not import decode.py (ops.py needs torch, so decode.py imports it only when
torch.compile traces a step)."""
import itertools
import weakref

# Weak: a wrapper leaves the registry when it is collected. The handle is given at
# construction, since torch.compile cannot trace the registration.
_WRAPPERS = weakref.WeakValueDictionary()
_HANDLES = itertools.count(1)


def register(wrapper):
    """A new handle for wrapper, which the registry holds until wrapper is collected."""
    handle = next(_HANDLES)
    _WRAPPERS[handle] = wrapper
    return handle


def lookup(handle):
    """The wrapper of handle, or None (no such handle, or its wrapper was collected)."""
    return _WRAPPERS.get(handle)
