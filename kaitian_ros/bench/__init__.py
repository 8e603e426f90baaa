"""Benchmarks of kaitian_ros (kaitian bench ...)."""
