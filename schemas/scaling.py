"""An elastic gang's scaling rules: which sizes it may take and when it may grow. Pure.

A job's ``replicas: {min, max}`` bound its size; its ``scaling`` section
(:class:`~phalanx.schemas.messages.ScalingPolicy`) narrows the sizes in
between and paces growth. :class:`ScalingRules` is that section as admission
applies it, and elasticity reads the allowed sizes from it too (so it lives here, in the
contract both services share, not in either of them):

* **Allowed sizes.** With ``replica_increment_step`` k: ``min, min + k, ...``
  up to ``max`` (``max`` itself only if it is on that ladder). With
  ``replica_discrete_values``: exactly those. Neither: every size in
  ``min..max``. The smallest allowed size is the one a gang is admitted at
  (all or nothing), so every planned size — admission, growth, a shrink by
  preemption or reclaim, a node loss's shrink, an operator's pin — is allowed.
* **Growth** goes to the largest allowed size the free capacity reaches,
  never above a pin; growth that cannot reach the next allowed size does not
  happen at all (three free slots do not make a ``[2, 4]`` gang 3).
* **Shrink** steps down the ladder one allowed size at a time, so a
  preemption takes only as many replicas as the next size down frees.
* **Cooldown.** No growth sooner than ``scale_up_cooldown_s`` after the
  gang's last size change (admission, growth, shrink): a gang shrunk for a
  short job does not flap back and forth with a stream of them.

Everything here is arithmetic on sizes; where replicas go is
:mod:`phalanx.services.admission.core`'s business.
"""

from __future__ import annotations

import bisect
import dataclasses

from phalanx.schemas.messages import JobSpec


@dataclasses.dataclass(frozen=True)
class ScalingRules:
    """The sizes a gang may take, ascending, and its growth cooldown."""

    sizes: tuple[int, ...]
    cooldown_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.sizes or list(self.sizes) != sorted(set(self.sizes)) or self.sizes[0] < 1:
            raise ValueError(f"sizes must be distinct, ascending and positive, "
                             f"got {self.sizes}")

    @classmethod
    def of(cls, spec: JobSpec) -> ScalingRules:
        """The rules of ``spec`` (its replicas and scaling section, validated at decode)."""
        low, high = spec.replicas.min, spec.replicas.max
        policy = spec.scaling
        if policy.replica_discrete_values is not None:
            sizes = tuple(v for v in policy.replica_discrete_values if low <= v <= high)
        else:
            sizes = tuple(range(low, high + 1, policy.replica_increment_step or 1))
        return cls(sizes, policy.scale_up_cooldown_s)

    @property
    def smallest(self) -> int:
        return self.sizes[0]

    @property
    def largest(self) -> int:
        return self.sizes[-1]

    def allows(self, size: int) -> bool:
        i = bisect.bisect_left(self.sizes, size)
        return i < len(self.sizes) and self.sizes[i] == size

    def at_most(self, size: int) -> int | None:
        """The largest allowed size not above ``size`` (None: below the smallest)."""
        i = bisect.bisect_right(self.sizes, size)
        return self.sizes[i - 1] if i else None

    def step_down(self, size: int) -> int | None:
        """The next allowed size below ``size`` (None: none)."""
        i = bisect.bisect_left(self.sizes, size)
        return self.sizes[i - 1] if i else None

    def grow_target(self, current: int, reachable: int, cap: int | None = None) -> int | None:
        """The size to grow to from ``current`` when capacity reaches ``reachable`` replicas
        in all: the largest allowed size above ``current`` and within ``reachable`` and
        ``cap`` (a pin); None when no allowed size is in reach."""
        limit = min(reachable, self.largest if cap is None else cap)
        target = self.at_most(limit)
        return target if target is not None and target > current else None

    def may_grow(self, changed_at: float, now: float) -> bool:
        """Whether the cooldown since the last size change (at ``changed_at``) is over."""
        return now >= changed_at + self.cooldown_s

    def pin_problem(self, replicas: int) -> str | None:
        """Why ``replicas`` cannot be pinned (None: it can)."""
        if self.allows(replicas):
            return None
        return (f"{replicas} replica(s) is not an allowed size of this job; allowed: "
                f"{', '.join(map(str, self.sizes))}")

    def describe(self) -> str:
        """One line for ``phalanx job``."""
        return f"sizes {', '.join(map(str, self.sizes))}; growth cooldown {self.cooldown_s:g} s"
