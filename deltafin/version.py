"""The release this is (the package's metadata says the same: tests/test_packaging.py). Workers announce it; a
coordinator and a worker of different releases still talk where their protocol versions agree (transport/codec.py)."""

__version__ = "0.1.0"
