"""GRPO on RolloutEngine: data (built-in tasks, a user's files, reasoning-gym; task_data / rows),
rewards (built-ins and a user's function; reward_fns / verifiers), loss and update, trainer, SFT warm
start, held-out evaluation, checkpoints, and the loop that ties them together."""
