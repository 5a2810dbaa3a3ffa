"""The package's version (kungfu.__version__, kungfu-run -V); pyproject.toml states the same one
(tests/unit/test_architecture.py checks that they agree)."""
__version__ = "0.1.0"
