"""The harness: runs a decoder beside the oracle (``runner``; the free, layer and op modes), compares sites into
the metrics table (``compare_sites``), and judges it once against the thresholds (``thresholds``, ``judgement``)."""
