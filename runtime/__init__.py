"""Rank-local runtime imported by training scripts.

So far: :class:`~phalanx.runtime.progress.ProgressReporter`, the per-step
progress that health's hang and straggler rules watch. Membership changes and
checkpointless recovery come with the runtime issue.
"""
