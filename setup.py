"""Builds the C ring (csrc/) and its Cython wrapper into shmloader._shm._ring."""

from Cython.Build import cythonize
from setuptools import Extension, setup

ring = Extension(
    "shmloader._shm._ring",
    sources=["shmloader/_shm/_ring.pyx", "csrc/shmring.c"],
    include_dirs=["csrc"],
    extra_compile_args=["-std=c11", "-O2", "-Wall", "-Wextra", "-Wno-unused-parameter"],
)

setup(ext_modules=cythonize([ring], language_level=3))
