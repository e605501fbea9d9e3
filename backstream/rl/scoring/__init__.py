"""Who scores: `[reward]` and the reward functions (TRL's signature: `rewards`), the built-in ones and the
spec strings that name them (`builtin`), a reward model (`reward_model`), reading an answer from text
(`answers`), DAPO's overlong shaping (`shaping`) and `[algorithm]`'s group advantages (`advantages`)."""
