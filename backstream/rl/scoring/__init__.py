"""Who scores: the reward functions (TRL's signature), the overlong shaping and the group advantages."""
