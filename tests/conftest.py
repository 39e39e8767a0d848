"""Session settings for the test suite.

One torch intra-op thread per test process: on 2-core machines torch's default two threads make small tensor ops
up to 40x slower when the other core is busy (measured: an element-wise op on 1M floats 0.2 ms with one thread,
~8 ms with two), and the suite's tensors are small. CI runs two pytest-xdist workers instead (``-n 2``).
"""

import torch

torch.set_num_threads(1)
