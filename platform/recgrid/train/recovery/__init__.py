"""Recovery: how a sharding group that lost a worker comes back, a file per concern.

2-D sparse parallelism keeps M whole copies of the model, one per sharding group, and the
sharding group is the unit of failure: Ray Train restarts a failed group's run alone, the other
groups keep their processes and train on, and the rebuilt group's workers start without state.
One restore order, decided at the group's first quorum:

  1. a live peer group's copy, in memory at the current step, shard s from shard s over
     torchft's transport (`peers`: the lighthouse, the manager, the replica component the
     trainer's loop calls, and the heal);
  2. with M = 1 (no peer, ever), the group's newest in-memory snapshot on the nodes' holders
     (`holders`, in shared-memory slot files: `slots`), when at least as new as:
  3. the job's newest storage checkpoint (`storage`, which also writes them);
  4. `train.resume_from`;
  5. step 0, said in the log and the run.

`coordinator` is the job's recovery actor (holders by node, checkpoints written, events);
`events` records how each group came back and logs it into the run once.
"""
