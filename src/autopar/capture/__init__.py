"""Capture: the torch.compile backend (Dynamo + AOTAutograd) that records each forward
and backward aten graph and hands it to the later stages on its first real call.

Owns the node key (``node_key``), graph tags and the per-graph records.
"""
