"""Codegen: the program that runs a plan. ``python`` (serial and CPU worker streams),
``cuda`` (CUDA streams and events) and ``torchscript`` (scripted segments) share one
builder; what the program prints is what runs.
"""
