"""RNNs: nn.LSTM/GRU and their cells rewritten into autopar's custom ops (``cells``,
``gru``), their forms and the measured choice between them (``layers``, ``choice``), and
the FX pass that fuses a user's cell loop (``fuse``).
"""
