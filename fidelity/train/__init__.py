"""Training the embedded default checkpoint: corpus (the Python standard library's sources), byte-level BPE
tokenizer, and a training loop that runs the oracle's own forward pass with autograd."""
