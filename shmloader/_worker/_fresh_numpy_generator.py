"""Imported only by some of shmloader's servers: each worker forked from the
server reseeds numpy's global generator from fresh entropy, as a process that
imports numpy.random afresh starts (NOTE [forkserver: fresh generators] in
_main/_forkserver.py)."""

import os

import numpy.random

os.register_at_fork(after_in_child=numpy.random.seed)
