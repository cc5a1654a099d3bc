"""The template te-core backend: every op it declares delegates to the reference (see README.md)."""

__version__ = "0.1.0"
