"""Choosing M and K: the planner (a cost model on TorchRec's estimators plus what 2-D adds),
the simulator that extends measured runs to thousands of GPUs, and the published constants."""
