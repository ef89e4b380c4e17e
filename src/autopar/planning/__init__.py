"""Planning: the task graph, the cost model, the partitioning policies, the simulator, the
plan verifier, the frozen ``Plan`` and its report (tables, networkx, Gantt).
"""
