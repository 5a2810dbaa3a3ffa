"""Shared test setup: make the in-tree package importable without installing it."""
import os
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(REPO_ROOT, "tests")  # helpers shared by the test folders (etcd_server.py)
for path in (REPO_ROOT, TESTS):
    if path not in sys.path:
        sys.path.insert(0, path)
