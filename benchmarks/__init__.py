"""Throughput benchmarks of the dispatcher against its ceilings and the hand-written baseline."""
