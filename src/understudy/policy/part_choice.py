"""method="auto": which part serves a request, from the tokens a second each has decoded.

The parts are the target's own head, the draft model, and none (plain decoding). Each is
credited with the tokens its requests decoded and charged their decoding's wall time
(drafting, the target's passes and verification together, the draft model's prefill
included): what pays on the machine it runs on, in the minute it runs in. `choose()` gives
each part MIN_TRIES requests in turn, then the one with the most tokens a second (decayed:
recent requests weigh more), and every PROBE_EVERY requests a part that is not chosen, in
turn, so its rate can recover.

Why time and not the costs timed at build: those model a round to within a few tenths of
a target pass, which is about the margin between the parts, and they leave out the draft
model's prefill, which on the editing prompts decided it (2-core Zen 4: modelled rates put
the draft model ahead; decoding, the head ran 1.88x plain and the draft model 1.44x).

Consequence: which part serves a request depends on wall times and on the requests served
before, so a seeded sampled output can differ between runs (its law is the target's all the
same); greedy output never changes. Lossless: every round is verified exactly whichever part
drafted it, and the choice reads only requests that have ended.
"""

from __future__ import annotations

from typing import Literal

Part = Literal["head", "model", "none"]


class PartChoice:
    MIN_TRIES = 1  # requests of each part before the rates decide
    PROBE_EVERY = 8  # requests between tries of a part that is not chosen
    DECAY = 0.9  # older requests count less: which part pays moves with the text

    def __init__(self, parts: tuple[Part, ...]) -> None:
        self.parts = parts
        self.tokens = dict.fromkeys(parts, 0.0)  # decayed tokens decoded by each part's requests
        self.seconds = dict.fromkeys(parts, 0.0)  # ... and their wall time
        self.tries = dict.fromkeys(parts, 0)
        self.since_probe = 0
        self.probes = 0

    def rate(self, part: Part) -> float:
        """Tokens a second over `part`'s requests so far (decayed)."""
        return self.tokens[part] / self.seconds[part] if self.seconds[part] else 0.0

    def choose(self) -> Part:
        """The part to serve the next request ("none": plain decoding)."""
        for part in self.parts:
            if self.tries[part] < self.MIN_TRIES:
                return part
        best = max(self.parts, key=self.rate)  # a tie: the first listed
        self.since_probe += 1
        if self.since_probe >= self.PROBE_EVERY:  # the parts not chosen, in turn
            self.since_probe = 0
            losers = [p for p in self.parts if p != best] or [best]
            self.probes += 1
            return losers[self.probes % len(losers)]
        return best

    def observe(self, part: Part, emitted: int, seconds: float) -> None:
        """A request `part` served: `emitted` tokens decoded in `seconds`."""
        for p in self.parts:
            self.tokens[p] *= self.DECAY
            self.seconds[p] *= self.DECAY
        self.tokens[part] += emitted
        self.seconds[part] += seconds
        self.tries[part] += 1
