"""Imported only by some of shmloader's servers: each worker forked from the
server reseeds torch's global CPU generator from fresh entropy, as a process
that imports torch afresh starts (NOTE [forkserver: fresh generators] in
_main/_forkserver.py)."""

import os

import torch

os.register_at_fork(after_in_child=torch.default_generator.seed)
