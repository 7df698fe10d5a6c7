"""The target split over several processes with MLX's distributed backend (mx.distributed).

Rank 0 owns everything a user sees (tokenizer, draft, sampling, decisions); the other ranks
each run a stage of the target's layers when rank 0 asks. See README, "Running across
machines"."""
