"""Profiling: every operator's time, FLOPs, bytes and dependencies (``profiler``), kept in
the versioned, load-aware JSON store under ``profiles/`` (``store``).
"""
