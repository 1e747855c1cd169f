"""asyncengine.kernels: the compute kernels, one file per op and backend (docs/kernels.md)."""
