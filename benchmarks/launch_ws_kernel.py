"""Launch one warp-specialized kernel three times on benchmark-shaped inputs, for a profiler to pick the last
launch (sm_90 GPU). ``indexer``: one query over 262144 FP4 keys (1M context); ``attention``: Flash decode b64, one
consumer warpgroup; ``attention-fp8``: the same on the 584 B FP8 layout (``_one_consumer_fp8_kernel``).

    ncu --clock-control none --section WarpStateStats --section SourceCounters -k regex:_index_ws_kernel \\
        -s 2 -c 1 -o DIR/indexer python3 benchmarks/launch_ws_kernel.py indexer
    ncu ... -k regex:_one_consumer_kernel -s 2 -c 1 -o DIR/attention python3 benchmarks/launch_ws_kernel.py attention
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from diag_indexer_ws import indexer_sets  # noqa: E402
from kernel_sections.attention import decode_sets  # noqa: E402

from fidelity.decoders.production.kernels import (  # noqa: E402
    indexer_ws,
    sparse_attention_ws,
    sparse_attention_ws_fp8kv,
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("kernel", choices=("indexer", "attention", "attention-fp8"))
    kernel = ap.parse_args().kernel
    if kernel == "indexer":
        q, packed, scales, w = indexer_sets(1, 262144, seed=7)[0]
        for _ in range(3):
            indexer_ws.index_scores_fp4_ws(q, packed, scales, w)
    elif kernel == "attention-fp8":
        s = decode_sets(64, 64, 512, 1, 8192, True)[0][0]
        for _ in range(3):
            sparse_attention_ws_fp8kv.sparse_attention_ws_fp8kv(s["q"], s["packed"], s["idx"], s["sink"], 512**-0.5,
                                                                consumers=1)
    else:
        s = decode_sets(64, 64, 512, 1, 8192, False)[0][0]
        for _ in range(3):
            sparse_attention_ws.sparse_attention_ws(s["q"], s["cache"], s["idx"], s["sink"], 512**-0.5, consumers=1)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
