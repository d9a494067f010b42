"""ds_z3native's benchmark suite: ``python -m bench <name|all> [--smoke]`` (or ``ds-z3native bench``).

Each benchmark is registered by name (one module each under ``bench/benchmarks/``, on the core in
``bench/core/``) with a GPU command builder (what runs on a CUDA machine) and a ``--smoke`` CPU
toy-size mode (what CI runs). Each writes one JSON file under
``bench/results/``; ``python -m bench.report`` turns them into the tables of
docs/benchmarks.md, the README's summary table and a plot.
This folder lives in the source checkout only: it is not installed with the package.
"""
