"""Profiling: every operator's time, FLOPs, bytes and dependencies (``profiler``), kept in
the versioned, load-aware JSON store in the user's cache directory (``store``:
``~/.cache/autopar/profiles`` unless ``$AUTOPAR_PROFILE_DIR`` or ``$XDG_CACHE_HOME`` says
otherwise).
"""
