"""Run the Triton kernels on the CPU through Triton's interpreter (set before triton loads)."""
import os

os.environ["TRITON_INTERPRET"] = "1"
