"""Codegen: the program that runs a plan. ``python`` (serial and CPU worker streams),
``cuda`` (CUDA streams and events) and ``native`` (the stream interpreter's instruction
lists) share one builder (``emitters`` picks one); what the program prints is what runs.
"""
