"""ZeRO stage 3 for one process: flat shards (partition), their movement around each module's use
(coordinator) and the offloaded Adam optimizer (optimizer)."""
