"""The launcher-free 2-D engine: the grid (T, M, L, layout and process groups), the one CPU/GPU
switch, the model, sharding inside sharding groups, the moment-scaled row-wise AdaGrad and the
replica sync. Imports nothing of recgrid but itself and `recgrid.data.specs`."""
