"""Tools the tests share: a snippet in a fresh interpreter (a crash fails one test instead of
ending the run), arrays that start off their dtype's alignment, and a spy on the addresses a
library function receives."""
import os
import pathlib
import subprocess
import sys
import textwrap

import numpy as np

import entmaxkv
from entmaxkv import _lib


def run_isolated(code, timeout=300):
    """Runs `code` in a new Python with this package and the tests' modules; returns the
    CompletedProcess (a segfault is returncode -11)."""
    env = dict(os.environ)
    root = str(pathlib.Path(entmaxkv.__file__).resolve().parents[1])
    tests = str(pathlib.Path(__file__).resolve().parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, tests, env.get("PYTHONPATH")) if p)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env,
                          capture_output=True, text=True, timeout=timeout)


def assert_runs(code):
    p = run_isolated(code)
    assert p.returncode == 0, f"exit {p.returncode}\n{p.stdout}\n{p.stderr}"


def unaligned(a):
    """A copy of a that starts one byte into a buffer: numpy takes it, the C code must not
    load from it."""
    a = np.asarray(a)
    buf = np.empty(a.nbytes + 1, np.uint8)
    u = buf[1:].view(a.dtype).reshape(a.shape)
    u[...] = a
    assert not u.flags.aligned
    return u


def spy(monkeypatch, name, positions):
    """Replaces the library function `name` by one that records its arguments at `positions`
    (the addresses of arrays) and calls it; returns the list they are recorded in."""
    real, seen = getattr(_lib.lib, name), []

    def call(*args):
        seen.extend(args[i] for i in positions)
        return real(*args)

    monkeypatch.setattr(_lib.lib, name, call)
    return seen
