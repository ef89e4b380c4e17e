"""Tools: the command line (``cli``), benchmarks (``bench``), the demo and the model zoo.
"""
