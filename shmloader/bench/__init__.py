"""The measuring library of shmloader's benchmarks (benchmarks/) and of
`python -m shmloader.compare`: one definition of every figure.

    measure    one loader: an epoch (throughput, main-process CPU, time waiting for data)
               and the first batch of a new loader
    check      the first epoch of several loaders side by side: the same batches?
    memory     peak memory of the process tree (psutil)
    limit      the transport-free limit: the workers' work with no hand-off
    session    the whole sequence over a set of loaders, in an order that keeps them apart
    figures    medians and ratios from what session measured
    machine    the machine and versions; record: the JSON record around the figures
    progress   status line and progress bar on stderr
    factory, preflight, verdict: compare's command line, its checks of a dataset before
               any loader starts, its table and conclusion
    plot       the charts: compare's, and those of benchmarks/bench.py and train.py
    errors     how a measurement fails; the bench extra (psutil, pillow, matplotlib)

Nothing is imported here, and the bench extra's packages only where they are used, so
that shmloader installs and imports without them.
"""
