"""The kernel interface: what a kernel family declares and how the harness finds
it (``api``)."""
