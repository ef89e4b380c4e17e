"""Runtime: what generated programs call while they run: CPU worker streams, intra-op
thread control, CUDA stream helpers (``streams``), and kernels (``kernels``).
"""
