"""Who learns: `[update]` and the update phase (`learner`), the RL objectives (`losses/`), the off-policy
weights and the sampler/learner mismatch (`offpolicy`), the backward `[engine]` chooses (`backward`) and
`[optim]`'s optimizer step (`optim`)."""
