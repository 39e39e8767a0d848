"""Studies: jobs that drive a decoder under test through many runs and judge them together, each split by job.

Scenarios (``fidelity scenarios``): ``catalogue`` (the scenarios as data), ``play`` (a run or script on a decoder),
``judge`` (self-consistency pairs through the logits-pair probe and threshold rules), ``scenarios`` (the job:
against the oracle and against the decoder itself). Mutants (``fidelity mutants``): ``mutants`` (the catalogue of
planted port bugs), ``mutant_runs`` (the clean decoder and each mutant on their scenario runs), ``detection`` (which
probe caught each, where, and the gate). ``jobdir``: the scenarios' and mutants' job directory, each finished run
kept in it for ``--resume``. ``recall`` (``fidelity recall``): the indexer's top-k recall per precision.
Each study's report is written by its writer in ``fidelity.outputs``."""
