"""The optional C part of te_triton's kernel launches (te_triton/_fastlaunch.c).

Everything else is in pyproject.toml. The extension uses only the CPython API (the CUDA driver
is opened at the first launch), so any C compiler builds it; where none is available the build
says so and the package installs without it: launches then stay in Python (te_triton.launch).
"""
from setuptools import Extension, setup

setup(ext_modules=[Extension("te_triton._fastlaunch", ["te_triton/_fastlaunch.c"], optional=True,
                             extra_compile_args=["-O2", "-std=c11"], libraries=["dl"])])
