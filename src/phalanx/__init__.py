"""Phalanx: a fault-tolerant, highly available cluster job scheduler."""

__version__ = "0.1.0"
