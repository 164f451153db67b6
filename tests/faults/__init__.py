"""Fault-injection suite (issue 7): kills, full disks, signals, non-finite numbers, lost ranks."""
