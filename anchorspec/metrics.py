"""Per-generation figures: forwards, drafted/accepted tokens, tau, acceptance per depth, time split."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    target_forwards: int = 0  # prefill + one per verification (or per token for vanilla)
    verify_steps: int = 0  # verifications of a non-empty draft (tau is averaged over these)
    drafted_tokens: int = 0  # tree nodes proposed (excluding the root)
    accepted_tokens: int = 0  # drafted tokens the verifier accepted
    reached_per_depth: list[int] = field(default_factory=list)  # steps whose draft reached depth d with d-1 accepted
    accepted_per_depth: list[int] = field(default_factory=list)  # ... and whose depth-d token was accepted
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    total_s: float = 0.0
    fallback_switches: int = 0  # switches between speculative and plain steps (decode/fallback.py)
    explored_steps: int = 0  # steps drafted with another candidate than the measured shape (StreamMonitor.explore)
    lookup_rows: int = 0  # drafted tokens a context-lookup chain added beside the drafter's (decode/lookup.py)
    lookup_tokens: int = 0  # accepted tokens past the drafter's own path: what the lookup chain won
    # verifications of a copied chain alone, no drafter pass: prompt lookup, a switched-off step that found a chain,
    # or a speculating step that priced the chain alone above the drafter's tree (StreamMonitor.chain_alone)
    copied_steps: int = 0

    def record_step(self, draft_depth: int, drafted: int, accepted: int) -> None:
        self.verify_steps += 1
        self.target_forwards += 1
        self.drafted_tokens += drafted
        self.accepted_tokens += accepted
        while len(self.reached_per_depth) < draft_depth:
            self.reached_per_depth.append(0)
            self.accepted_per_depth.append(0)
        for d in range(1, draft_depth + 1):
            if accepted >= d - 1:
                self.reached_per_depth[d - 1] += 1
            if accepted >= d:
                self.accepted_per_depth[d - 1] += 1

    @property
    def tau(self) -> float:
        """Mean acceptance length per verification, the bonus token included (EAGLE's tau); 0.0 when nothing
        was verified (to_dict then says None: plain decoding has no tau)."""
        return (self.accepted_tokens + self.verify_steps) / self.verify_steps if self.verify_steps else 0.0

    @property
    def acceptance_per_depth(self) -> list[float]:
        """Conditional rate: P(depth d accepted | depth d-1 accepted and a depth-d draft existed)."""
        return [a / r if r else 0.0 for a, r in zip(self.accepted_per_depth, self.reached_per_depth)]

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.total_s if self.total_s > 0 else 0.0

    @property
    def other_s(self) -> float:
        return max(self.total_s - self.prefill_s - self.draft_s - self.verify_s, 0.0)

    def merge(self, other: "GenerationStats") -> "GenerationStats":
        out = GenerationStats()
        for name in ("prompt_tokens", "new_tokens", "target_forwards", "verify_steps", "drafted_tokens",
                     "accepted_tokens", "prefill_s", "draft_s", "verify_s", "total_s", "fallback_switches",
                     "explored_steps", "lookup_rows", "lookup_tokens", "copied_steps"):
            setattr(out, name, getattr(self, name) + getattr(other, name))
        depth = max(len(self.reached_per_depth), len(other.reached_per_depth))
        pad = lambda xs: xs + [0] * (depth - len(xs))  # noqa: E731
        out.reached_per_depth = [a + b for a, b in zip(pad(self.reached_per_depth), pad(other.reached_per_depth))]
        out.accepted_per_depth = [a + b for a, b in zip(pad(self.accepted_per_depth), pad(other.accepted_per_depth))]
        return out

    @classmethod
    def from_dict(cls, d: dict) -> "GenerationStats":
        """Inverse of to_dict (for records read back from JSON)."""
        t = d.get("time_s", {})
        return cls(prompt_tokens=d["prompt_tokens"], new_tokens=d["new_tokens"], target_forwards=d["target_forwards"],
                   verify_steps=d["verify_steps"], drafted_tokens=d["drafted_tokens"],
                   accepted_tokens=d["accepted_tokens"], reached_per_depth=list(d["reached_per_depth"]),
                   accepted_per_depth=list(d["accepted_per_depth"]), prefill_s=t.get("prefill", 0.0),
                   draft_s=t.get("draft", 0.0), verify_s=t.get("verify", 0.0), total_s=t.get("total", 0.0),
                   fallback_switches=d.get("fallback_switches", 0), explored_steps=d.get("explored_steps", 0),
                   lookup_rows=d.get("lookup_rows", 0), lookup_tokens=d.get("lookup_tokens", 0),
                   copied_steps=d.get("copied_steps", 0))

    def to_dict(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "new_tokens": self.new_tokens,
            "target_forwards": self.target_forwards,
            "verify_steps": self.verify_steps,
            "drafted_tokens": self.drafted_tokens,
            "accepted_tokens": self.accepted_tokens,
            "tau": round(self.tau, 4) if self.verify_steps else None,  # plain decoding: no tau, not 0
            "acceptance_per_depth": [round(x, 4) for x in self.acceptance_per_depth],
            "accepted_per_depth": list(self.accepted_per_depth),
            "reached_per_depth": list(self.reached_per_depth),
            "tokens_per_s": round(self.tokens_per_s, 3),
            "fallback_switches": self.fallback_switches,
            "explored_steps": self.explored_steps,
            "lookup_rows": self.lookup_rows,
            "lookup_tokens": self.lookup_tokens,
            "copied_steps": self.copied_steps,
            "time_s": {
                "total": round(self.total_s, 4),
                "prefill": round(self.prefill_s, 4),
                "draft": round(self.draft_s, 4),
                "verify": round(self.verify_s, 4),
                "other": round(self.other_s, 4),
            },
        }
