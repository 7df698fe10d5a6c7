"""The target split over several processes with MLX's distributed backend (mx.distributed).

Rank 0 owns everything a user sees (tokenizer, draft, sampling, decisions); the other ranks
run their part of each of the target's forwards when rank 0 asks: a stage of its layers
(pipeline parallel) or every layer's share of the heads and MLP width (tensor parallel). See
README, "Running across machines"."""
