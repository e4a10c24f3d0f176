"""When `auto` tries again the drafting it decided against (issue 58): an explicit exploration rule,
deterministic under a seed, with a bounded cost.

A decision made from costs and acceptance learnt online only learns about what it does: once
plain steps win, nothing more is measured about drafting at this context, nor about this
request's acceptance. So while the decision is plain and a tree is possible, a `Probes` drafts
the best tree anyway after a wait: FIRST plain steps the first time, twice as many after each
probe that did not win the decision back, at most LONGEST. A probe costs one step at most the
predicted gap slower than plain; over T steps there are at most log2(LONGEST / FIRST) +
T / ((1 - JITTER) LONGEST) of them, so at a gap g the loss stays below g / 36 of the time beyond
the first few probes (a 30% gap: under 1%). A draft that starts to pay is found within LONGEST + 1 steps of the change:
the next probe measures it, and a probe that measured drafting faster than the plain step goes
on drafting (up to RUN steps in all) while it keeps winning, so the estimates it corrects catch
up with the change instead of moving a tenth of the way per probe; such steps lose nothing.
The waits are jittered by a seeded generator (so the requests of a server do not all probe in
one step) and are otherwise fixed: the same seed and the same decisions and outcomes probe at
the same steps.
"""
from __future__ import annotations

import random

FIRST = 4  # plain steps before the first probe
LONGEST = 48  # the longest wait between probes
JITTER = 0.25  # each wait is drawn from [1 - JITTER, 1 + JITTER] times its nominal length
RUN = 8  # the most steps one probe drafts while each measures a win


class Probes:
    """Counts the plain steps taken where a tree was possible and says when to probe."""

    def __init__(self, seed: int = 0, first: int = FIRST, longest: int = LONGEST):
        self.first, self.longest = first, longest
        self.reseed(seed)
        self.probes = 0  # probe steps drafted, for the stats

    def reseed(self, seed: int) -> None:
        self._rng = random.Random(seed)
        self._nominal = self.first
        self._wait = self._draw(self._nominal)
        self._waited = 0
        self._run = 0  # steps of the probe under way (0: none)
        self._again = False  # its last step won: draft the next one too

    def _draw(self, nominal: int) -> int:
        return max(1, round(nominal * self._rng.uniform(1.0 - JITTER, 1.0 + JITTER)))

    def step(self, drafting_wins: bool) -> bool:
        """Before a step where the model could draft: `drafting_wins`, what the decision says.
        True: draft this step although the decision is plain (a probe)."""
        if drafting_wins:  # the decision itself drafts: the waits start short again
            self._waited, self._run, self._again = 0, 0, False
            if self._nominal != self.first:
                self._nominal = self.first
                self._wait = self._draw(self.first)
            return False
        if self._again and self._run < RUN:
            self._again = False
            self._run += 1
            self.probes += 1
            return True
        self._run, self._again = 0, False
        self._waited += 1
        if self._waited < self._wait:
            return False
        self._waited = 0
        self._nominal = min(self.longest, 2 * self._nominal)
        self._wait = self._draw(self._nominal)
        self._run = 1
        self.probes += 1
        return True

    def result(self, won: bool) -> None:
        """After a probe's step: whether it emitted tokens faster than the plain step would have."""
        self._again = won and 0 < self._run
