"""What a run leaves and shows: checkpoints, metrics and step reports, rollout dumps, the control service and the end of
a run."""
