"""A generation's cause as text: failures quoted briefly, lists of replicas bounded. Pure.

A generation goes to every member and its cause into the job's history: a node's eight
ranks failing with their last output each must not make either too big to send or store.
"""

from __future__ import annotations

#: The most of one replica's failure a cause quotes (its first line), and of each list in
#: it (replicas dropped, left, joined) before "and N more".
WHY_CHARS = 200
LIST_CHARS = 400


def clip(text: str, limit: int) -> str:
    """``text``, cut to ``limit`` characters with an ellipsis when longer."""
    return text if len(text) <= limit else text[:limit - 1] + "\u2026"


def brief(detail: str, default: str = "failed") -> str:
    """A replica's failure as a cause quotes it: its first non-empty line, clipped."""
    first = next((line.strip() for line in detail.splitlines() if line.strip()), default)
    return clip(first, WHY_CHARS)


def listing(items: list[str]) -> str:
    """``items`` comma-separated within about ``LIST_CHARS`` ("..., and N more")."""
    shown: list[str] = []
    used = 0
    for item in items:
        if shown and used + len(item) > LIST_CHARS:
            return ", ".join(shown) + f" and {len(items) - len(shown)} more"
        shown.append(item)
        used += len(item) + 2
    return ", ".join(shown)
