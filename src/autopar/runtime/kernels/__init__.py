"""Hand-written kernels autopar's custom ops dispatch to on accelerators.

Submodules import their kernel language (e.g. Triton) lazily so that importing
:mod:`autopar` never requires it:

* :mod:`autopar.runtime.kernels.triton_cells` -- LSTM/GRU cell pointwise forward/backward (Triton),
  used by ``autopar::lstm_cell`` / ``autopar::gru_cell`` and their backward ops on CUDA.
"""
