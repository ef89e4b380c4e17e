"""Parallel training: ``compile_step`` (the whole step), data and pipeline parallelism
(``distributed``) and the single-process multi-GPU program (``multigpu``).
"""
