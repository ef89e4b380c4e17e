"""Adapt: the run-time monitor (timing each graph call against the plan's prediction,
drift, re-planning) and the bounded per-input-signature plan cache (``shapes``).
"""
