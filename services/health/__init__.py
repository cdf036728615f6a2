"""Failure detection: crashed, hung and straggling ranks, lost and cordoned nodes."""
