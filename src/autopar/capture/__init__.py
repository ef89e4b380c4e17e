"""Capture: the torch.compile backend (Dynamo + AOTAutograd) that records each forward
and backward aten graph and hands it to the later stages on its first real call.

Owns the node key (``node_key``), graph tags, the per-graph units and records
(``backend``) and the static graph analysis: writes, views, random ops (``analysis``).
"""
