"""The log of kernel wrappers that ran the emulation instead (recorded in run manifests)."""

from fidelity.decoders.production import fallbacks


def test_fallbacks_count_calls_per_op_and_reason_until_reset():
    fallbacks.reset()
    fallbacks.note("sparse_attention", "fmt 'fp4'")
    fallbacks.note("sparse_attention", "fmt 'fp4'")
    fallbacks.note("hc_pre", "injected Sinkhorn fault")
    assert fallbacks.counts() == {"sparse_attention": {"fmt 'fp4'": 2}, "hc_pre": {"injected Sinkhorn fault": 1}}
    snapshot = fallbacks.counts()
    snapshot["hc_pre"]["injected Sinkhorn fault"] = 99  # a copy: the log is not changed through it
    assert fallbacks.counts()["hc_pre"] == {"injected Sinkhorn fault": 1}
    fallbacks.reset()
    assert fallbacks.counts() == {}
