"""A template te-core backend. Copy this folder to start a vendor backend (see README.md)."""

__version__ = "0.1.0"
