"""Choosing M and K, and the plan a job runs: ONE planner (a cost model on TorchRec's estimators,
per device, plus what 2-D adds), used by `recgrid plan` and by a job's `model.sharding: auto`;
split like TorchRec's: enumerators, estimators, proposers, partitioners, then rating (2-D),
report, planner, cli. Also the simulator that extends it to thousands of GPUs (simulate), the
published and measured constants (constants), RecScale's compression in the planner (recscale),
and the tower feature clustering of Disaggregated Multi-Tower (feature_clusters)."""
