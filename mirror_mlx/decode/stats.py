"""The one stats object that flows from the decoders to the CLI, the API, the server and the
bench: the same field names everywhere."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class GenerationStats:
    mode: str = "ar"
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0  # prompt tokens whose KV cache was reused, not prefilled
    generated_tokens: int = 0
    committed_tokens: int = 0  # generated plus the end-of-sequence token, if one ended it
    finish_reason: str = ""  # stop | length | context | cancelled
    ttft_s: float = 0.0  # request start -> first token known
    prefill_s: float = 0.0
    decode_s: float = 0.0  # end of prefill -> last token
    total_s: float = 0.0
    peak_memory_gb: float = 0.0
    # Speculative decoding; for AR every step commits exactly one token.
    target_steps: int = 0
    draft_tokens: int = 0  # drafted tokens that the target verified
    accepted_tokens: int = 0  # of those, accepted
    reuse_steps: int = 0  # Mirror-SD steps whose next window came from a branch rollout
    fallback_steps: int = 0  # Mirror-SD steps that drafted afresh after verification
    exit_positions: int = 0  # verified window positions whose target token is known ...
    exit_covered: int = 0  # ... and of those, how many the early exit had in its top-kappa
    plan_steps: dict[str, int] = field(default_factory=dict)  # Mirror-SD steps per plan
    draft_lengths: dict[int, int] = field(default_factory=dict)  # steps by tokens verified (auto)
    schedule: str = ""  # Mirror-SD: the plan the scheduler prefers now, and why
    draft_fault: str = ""  # why the draft was given up mid-generation (decoding went on as AR)
    time_s: dict[str, float] = field(default_factory=dict)  # target_prefix, draft, wait, ...
    overlap_fraction: float = 0.0  # share of draft time hidden under target compute
    ranks: int = 1  # processes that ran the target
    split: list[int] = field(default_factory=list)  # its layers per rank, rank 0 first
    parallel: str = ""  # how it was split over them: "tensor" or "pipeline" ("" in one)
    comm_s: float = 0.0  # seconds each target step spent in transfers between ranks (a probe's)

    @property
    def prompt_tokens_per_second(self) -> float:
        filled = self.prompt_tokens - self.cached_prompt_tokens
        return filled / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.decode_s if self.decode_s > 0 else 0.0

    @property
    def acceptance_length(self) -> float:
        """Tokens committed per target step (accepted drafts plus the target's own token)."""
        return self.committed_tokens / self.target_steps if self.target_steps else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def exit_coverage(self) -> float:
        return self.exit_covered / self.exit_positions if self.exit_positions else 0.0

    @property
    def reuse_rate(self) -> float:
        decided = self.reuse_steps + self.fallback_steps
        return self.reuse_steps / decided if decided else 0.0

    @property
    def fallback_rate(self) -> float:
        decided = self.reuse_steps + self.fallback_steps
        return self.fallback_steps / decided if decided else 0.0

    def record_step(self, drafted: int, accepted: int) -> None:
        """One target forward that verified `drafted` tokens and accepted `accepted`."""
        self.target_steps += 1
        self.draft_tokens += drafted
        self.accepted_tokens += accepted

    def add_time(self, key: str, seconds: float) -> None:
        self.time_s[key] = self.time_s.get(key, 0.0) + seconds

    def to_dict(self) -> dict:
        out = asdict(self)
        for name in ("prompt_tokens_per_second", "tokens_per_second", "acceptance_length",
                     "acceptance_rate", "reuse_rate", "fallback_rate", "exit_coverage"):
            out[name] = getattr(self, name)
        return {k: round(v, 6) if isinstance(v, float) else v for k, v in out.items()}

    def summary(self) -> str:
        parts = [
            f"mode {self.mode}",
            f"prompt {self.prompt_tokens} tok"
            + (f" ({self.cached_prompt_tokens} cached)" if self.cached_prompt_tokens else ""),
            f"{self.prompt_tokens_per_second:.1f} tok/s",
            f"TTFT {self.ttft_s:.3f}s",
            f"generated {self.generated_tokens} tok at {self.tokens_per_second:.1f} tok/s",
        ]
        if self.mode != "ar":
            parts.append(f"{self.acceptance_length:.2f} tok/step")
            parts.append(f"acceptance {self.acceptance_rate:.0%}")
            if self.draft_lengths:
                parts.append("tokens verified per step: " + ", ".join(
                    f"{k}×{v}" for k, v in sorted(self.draft_lengths.items())))
        if self.mode == "mirror":
            parts.append(f"reuse {self.reuse_rate:.0%}")
            parts.append(f"overlap {self.overlap_fraction:.0%}")
            steps = ", ".join(f"{k} {v}" for k, v in sorted(self.plan_steps.items()))
            parts.append(f"steps by plan: {steps}")
            parts.append(f"schedule {self.schedule}")
        if self.parallel:
            parts.append(f"{self.ranks} ranks ({self.parallel}, transfers ~{self.comm_s * 1e3:.1f} "
                         f"ms a step)")
        parts.append(f"peak {self.peak_memory_gb:.2f} GB")
        parts.append(f"finish {self.finish_reason}")
        return " | ".join(parts)
