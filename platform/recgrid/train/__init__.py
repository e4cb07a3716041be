"""Training on one worker: the Stateful trainer and its loop, metrics, storage checkpoints,
in-memory recovery from replica-group peers, and the Ray Train worker body."""
