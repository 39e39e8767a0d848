"""The harness: runs a decoder beside the oracle (``runner``; the free, layer and op modes through
``oracles.Reference``), turns pairs of site records into the metrics table (``site_pairs``), and judges it once
against the thresholds (``thresholds``, ``judgement``)."""
