"""Planning: the task graph, the cost model, the partitioning policies (``policies``: one
registry), the list scheduler (``listsched``), the simulator, the vector clocks
(``clocks``: syncs, waits, verification), the plan verifier, the frozen ``Plan`` and its
report (tables, networkx, Gantt).
"""
