"""runtime layer of kaitian_ros (see docs/architecture.md)."""
