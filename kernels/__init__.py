"""asyncengine.kernels: attention and cache kernels, each with a torch reference."""
