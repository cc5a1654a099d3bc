"""te-backend-musa: the te-core backend for Moore Threads GPUs (MUSA) through torch_musa.

The plugin lives in te_backend_musa.plugin (entry point `musa`); see README.md for what runs
natively, what falls back to the reference and why.
"""
__version__ = "0.1.0"
