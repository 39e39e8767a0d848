"""The allocator probe on CUDA (skipped without one): the built-in decoder makes no device malloc and keeps
nothing after the warm-up, in a real ``fidelity run`` (graph decode, its default, and eager decode) and in a graph
decode session; the ``decode-buffer-kept`` mutant is caught by the CUDA counters as well as by held_growth."""

import pytest
import torch

from fidelity.decoders.production.graph_decode import GraphDecodeSession

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

import fidelity  # noqa: E402
from fidelity.decoders.production import ProductionModel  # noqa: E402
from fidelity.decoders.production.decoder import ProductionDecoder  # noqa: E402
from fidelity.model.default import prompt_for  # noqa: E402
from fidelity.model.load import load_checkpoint  # noqa: E402
from fidelity.studies.mutant_runs import MutantSettings, run_one  # noqa: E402
from fidelity.studies.mutants import BY_NAME  # noqa: E402
from probes.memory import WARMUP_DECODE_CALLS, measured_call  # noqa: E402

SETTINGS = MutantSettings(decode_steps=24, modes=("layer",), device="cuda")


@pytest.fixture(scope="module")
def ckpt():
    return load_checkpoint(fidelity.default_checkpoint())


def _cuda_run(ckpt, mutant, graphs: bool | None = None):
    """The mutant's run on CUDA; ``graphs`` False: the production decoder decodes eagerly (None: its default)."""
    def eager():
        return ProductionDecoder(ckpt, "reference", 4096, "cuda", graphs=False)

    return run_one(ckpt, mutant, SETTINGS, decoder=None if graphs is None else eager)


def _values(df, metric):
    return df[(df["site"] == "memory") & (df["metric"] == metric)]


@pytest.mark.parametrize("graphs", [None, False], ids=["graph decode", "eager decode"])
def test_clean_cuda_decode_makes_no_device_malloc_and_keeps_nothing_after_the_warm_up(ckpt, graphs):
    df = _cuda_run(ckpt, None, graphs)
    mallocs = _values(df, "new_device_mallocs")
    assert len(mallocs) == SETTINGS.decode_steps - WARMUP_DECODE_CALLS and (mallocs["value"] == 0).all()
    for metric in ("held_growth", "retained_growth", "reserved_growth"):
        assert (_values(df, metric)["value"] == 0).all(), metric
    assert df[df["site"] == "memory"]["passed"].all()


def test_kept_decode_buffer_shows_in_the_cuda_counters(ckpt):
    df = _cuda_run(ckpt, BY_NAME["decode-buffer-kept"])
    retained = _values(df, "retained_growth")["value"]
    held = _values(df, "held_growth")["value"]
    assert retained.iloc[-1] >= held.iloc[-1] > 0
    assert not _values(df, "retained_growth")["passed"].all() and not _values(df, "held_growth")["passed"].all()


def test_graph_decode_replays_allocate_nothing_but_the_returned_logits(ckpt):
    """A replayed step copies the token into the graph's input buffer and allocates only the logits it returns
    (a clone: the graph's own output buffer is overwritten by the next replay)."""
    session = GraphDecodeSession(ProductionModel(ckpt, "reference", 340, "cuda"))
    logits = session.prefill(prompt_for(ckpt, 300, 0).cuda())[-1]
    deltas = []
    for _ in range(24):
        token = int(logits.argmax())
        logits, delta = measured_call(lambda: session.step(token), "cuda")  # noqa: B023 (called at once)
        deltas.append(delta)
    assert session.replays == 24 - 1
    for d in deltas[WARMUP_DECODE_CALLS:]:
        assert d["device_mallocs"] == 0 and d["alloc_calls"] == 1 and d["retained_delta"] == 0, d
