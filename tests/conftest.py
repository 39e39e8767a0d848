"""Session settings for the test suite.

One torch intra-op thread per test process: on 2-core machines torch's default two threads make small tensor ops
up to 40x slower when the other core is busy (measured: an element-wise op on 1M floats 0.2 ms with one thread,
~8 ms with two), and the suite's tensors are small. CI runs two pytest-xdist workers instead (``-n 2``).

Hypothesis profiles: ``deterministic`` (the default: derandomized, no example database, no deadline, so that a run
of the README's command, CI's included, draws the same examples every time) and ``explore`` (random draws and the
example database; 300 examples where a test sets no count; ``pytest --hypothesis-profile explore``). A test's own
``@settings(max_examples=...)`` keeps its count and inherits the rest from the profile.
"""

import torch
from hypothesis import settings

torch.set_num_threads(1)

settings.register_profile("deterministic", derandomize=True, database=None, deadline=None, print_blob=True)
settings.register_profile("explore", deadline=None, max_examples=300)
settings.load_profile("deterministic")
