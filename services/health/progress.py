"""How far a job has trained: its step, total steps and step rate, from its ranks' reports. Pure.

Health hears every rank's progress report (:class:`~phalanx.schemas.messages.RankProgress`),
so it is where a job's progress is known; :class:`StepTrack` keeps one job's:

* **Step**: the most steps any rank reported committed since the job was
  admitted (the ranks of a data-parallel job commit the same steps; one that
  lags behind by a report does not move it back).
* **Total steps**: what the ranks' runtime says the training runs to, when it
  says (a script without the runtime's session does not).
* **Rate**: steps per second from the oldest step change within the last
  ``window_s`` (or, after a longer pause, the last one before it) to ``now``,
  so a pause for a recovery slows it and a stalled job's rate falls towards 0.

The track is timing state, like the detector's last reports: it is not part
of health's snapshot, and a new leader starts it afresh from the next report.

A job requeued and admitted again starts a new track at step 0; what it had
reached is carried in the stored record instead (:func:`carried`), so the
step a job reached outlives its admissions and health's leaders alike.
"""

from __future__ import annotations

import collections
import dataclasses

import msgspec

from phalanx.schemas.messages import JobProgress

#: How far back the rate looks (seconds).
RATE_WINDOW_S = 30.0


@dataclasses.dataclass
class StepTrack:
    """One job's progress since its admission."""

    window_s: float = RATE_WINDOW_S
    step: int = 0
    total_steps: int | None = None
    # (when the step advanced, to which step), oldest first: the window, and one before it
    changes: collections.deque[tuple[float, int]] = dataclasses.field(
        default_factory=collections.deque)

    def reported(self, step: int, total_steps: int | None, now: float) -> bool:
        """A rank reported ``step`` committed (of ``total_steps``) at ``now``; returns
        whether what is known of the job changed."""
        changed = total_steps is not None and total_steps != self.total_steps
        if changed:
            self.total_steps = total_steps
        if step > self.step:
            self.step = step
            self.changes.append((now, step))
            changed = True
        while len(self.changes) > 1 and self.changes[1][0] < now - self.window_s:
            self.changes.popleft()
        return changed

    def rate(self, now: float) -> float | None:
        """Steps per second up to ``now``; None until the step has changed twice."""
        if len(self.changes) < 2:
            return None
        since, first = self.changes[0]
        elapsed = now - since
        return (self.step - first) / elapsed if elapsed > 0 else None


def carried(stored: JobProgress | None, new: JobProgress) -> JobProgress:
    """``new`` as stored over ``stored``: its ``reached`` the most steps either says
    were committed (a step stored was committed in some admission of the job)."""
    before = 0 if stored is None else stored.reached_step()
    return msgspec.structs.replace(new, reached=max(new.reached_step(), before))
