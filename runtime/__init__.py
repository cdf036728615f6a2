"""Rank-local runtime imported by training scripts (see the runtime issue)."""
