"""What a DeepSeek-V4 model is, shared by the oracle and every decoder: its config, number formats, weights
(the schema in ``weights``, read by ``load``, written by ``save``, held by ``checkpoint``), the synthetic and the
default checkpoints, the tokenizer, the site table and the sampler. Imports nothing above it."""
