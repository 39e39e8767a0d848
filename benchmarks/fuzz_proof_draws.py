"""Which of the first N scripts ``fidelity fuzz --seed S --max-context C`` draws would make each plant of
tests/fuzz_plants.py fire (draws only, nothing judged: seconds), to pick a context at which a budget can reach a
plant's trigger (docs/fuzz.md, benchmarks/results/2026-12-07-fuzz-proof/draws.txt).

    OMP_NUM_THREADS=1 python benchmarks/fuzz_proof_draws.py 288 0 200     # context, seed, scripts
"""

from __future__ import annotations

import statistics
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fidelity.studies.catalogue import Feed, Fork, Script  # noqa: E402
from fidelity.studies.fuzz import Space  # noqa: E402
from fidelity.studies.fuzz_judge import Verdict  # noqa: E402
from fidelity.studies.fuzz_run import search  # noqa: E402


def triggers(s: Script) -> set[str]:
    """The plants whose trigger ``s`` makes (their conditions in tests/fuzz_plants.py)."""
    pos: dict[int, int] = {}
    origin: dict[int, tuple] = {}
    got, wide = set(), set()
    for op in s.ops:
        if isinstance(op, Feed):
            for k, n in op.calls:
                p = pos.get(k, 0)
                if k in wide:  # a call after the 8-token call reads the stale window ring
                    got.add("resumed-prefill-as-verify")
                if ("rolled back", k) in wide:
                    got.add("aligned-fork-rollback")
                if n == 8 and p > 0:
                    wide.add(k)
                pos[k] = p + n
                if pos[k] > 768:
                    got.add("past-768-topk")
        elif isinstance(op, Fork):
            if op.parent in origin:
                root = op.parent
                while root in origin:
                    root = origin[root][0]
                if op.pos > origin[op.parent][1] and pos[root] >= op.pos:
                    got.add("fork-of-fork-root")
            origin[op.seq] = (op.parent, op.pos, op.pos % 256 == 0)
            pos[op.seq] = op.pos
        else:
            if op.accept < op.n and origin.get(op.seq, (0, 0, False))[2]:
                wide.add(("rolled back", op.seq))  # seen once a later call reads what the rollback left
            pos[op.seq] += op.accept
    return got


def main() -> None:
    context, seed, n = (int(a) for a in sys.argv[1:4])
    seen: list[tuple[set[str], Script]] = []

    def judge_one(s: Script, oracle: bool) -> Verdict:
        seen.append((triggers(s), s))
        return Verdict("stop" if len(seen) >= n else "")

    search(Space(context=context), seed, 120, judge_one, 0.0, lambda line: None)
    count = Counter(t for got, _ in seen for t in got)
    first: dict[str, int] = {}
    for i, (got, _) in enumerate(seen):
        for t in got:
            first.setdefault(t, i + 1)
    mean = statistics.mean(sum(k for _, segs in s.streams for _, k in segs) for _, s in seen)
    print(f"context {context}, seed {seed}, {len(seen)} scripts: scripts firing {dict(count)}, first at {first}, "
          f"mean stream tokens {mean:.0f}")


if __name__ == "__main__":
    main()
