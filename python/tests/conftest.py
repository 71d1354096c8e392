"""The tests import the installed package (pip install .), or a source tree with
$ENTMAXKV_LIBRARY pointing at a built libentmaxkv.so (python/ is added to the path then)."""
import os
import pathlib
import sys

if os.environ.get("ENTMAXKV_LIBRARY"):
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
