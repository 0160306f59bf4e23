"""shmloader's tests (see CONTRIBUTING.md for where each kind lives).

SHMLOADER_TEST_START_METHOD=forkserver (or spawn) makes it the default start
method of every process that imports the tests, drivers included, as Python
3.14 makes forkserver the default on Linux; loaders not given a
multiprocessing_context then start their workers with it."""

import os

_START_METHOD = os.environ.get("SHMLOADER_TEST_START_METHOD")
if _START_METHOD:
    import multiprocessing

    multiprocessing.set_start_method(_START_METHOD, force=True)
    if _START_METHOD == "forkserver":
        # As a training script's forkserver preloads torch (its __main__, Python's default
        # list, imports it): under pytest __main__ is pytest's, and each of torch's own
        # workers would import torch afresh (shmloader's server preloads this list too).
        multiprocessing.set_forkserver_preload(["__main__", "torch"])
