"""The kernel benchmarks of ``benchmarks/bench_kernels.py``, one module per kernel family (``bench_<family>(quick)``
validates, then times, appending to ``common.RESULTS``); ``common`` holds the timing, records and ceilings."""
