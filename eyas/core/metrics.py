"""Acceptance metrics: per request and engine-wide, with the words of architecture.md."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecStats:
    """Counts over verification steps that carried drafts.

    Example: k = 3, one step drafts 3 tokens and 2 are accepted, the next drafts 3 and 0 are
    accepted: drafted 6, accepted 2, steps 2, mean acceptance length (2 + 1 + 0 + 1) / 2 = 2.0,
    per-position acceptance [1/2, 1/2, 0/2].

    Drafts forced by the request's grammar (it admitted that token only) are counted apart too:
    ``num_forced`` of them were reached by verification (every draft before them accepted),
    ``num_forced_accepted`` were accepted; the two are equal, since a forced token is the only one
    the target can emit there.
    """

    num_steps: int = 0
    num_drafted: int = 0
    num_accepted: int = 0
    drafted_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)
    num_forced: int = 0
    num_forced_accepted: int = 0

    def record(self, num_drafts: int, num_accepted: int, forced: list[bool] = ()) -> None:
        """``forced``: per draft, whether the grammar forced it (empty: none was)."""
        if num_drafts == 0:
            return
        self.num_steps += 1
        self.num_drafted += num_drafts
        self.num_accepted += num_accepted
        self.num_forced += sum(forced[:num_accepted + 1])
        self.num_forced_accepted += sum(forced[:num_accepted])
        for i in range(num_drafts):
            self.record_position(i, 1, int(i < num_accepted))

    def merge(self, other: "SpecStats") -> None:
        for i in range(len(other.drafted_per_position)):
            self.record_position(i, other.drafted_per_position[i], other.accepted_per_position[i])
        self.num_steps += other.num_steps
        self.num_drafted += other.num_drafted
        self.num_accepted += other.num_accepted
        self.num_forced += other.num_forced
        self.num_forced_accepted += other.num_forced_accepted

    def record_position(self, i: int, drafted: int, accepted: int) -> None:
        while len(self.drafted_per_position) <= i:
            self.drafted_per_position.append(0)
            self.accepted_per_position.append(0)
        self.drafted_per_position[i] += drafted
        self.accepted_per_position[i] += accepted

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per target forward that carried drafts (accepted + 1)."""
        return (self.num_accepted + self.num_steps) / self.num_steps if self.num_steps else 1.0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted / self.num_drafted if self.num_drafted else 0.0

    def as_dict(self) -> dict:
        return {
            "num_steps": self.num_steps,
            "num_drafted": self.num_drafted,
            "num_accepted": self.num_accepted,
            "acceptance_rate": self.acceptance_rate,
            "mean_acceptance_length": self.mean_acceptance_length,
            "per_position_acceptance": [a / d if d else 0.0 for a, d in
                                        zip(self.accepted_per_position, self.drafted_per_position)],
            "drafted_per_position": list(self.drafted_per_position),
            "accepted_per_position": list(self.accepted_per_position),
            "num_forced": self.num_forced,
            "num_forced_accepted": self.num_forced_accepted,
        }
