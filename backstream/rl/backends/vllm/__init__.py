"""Rollouts on a vLLM server (docs/design.md §1, the QaRL paper's hybrid): the server samples, the
learner publishes its weights to it after every optimizer step. `setup` builds vLLM's own virtual
environment, `server` starts and talks to it, `sampler` is the rollout backend behind the sampler
protocol (rl/rollout/sampler.py), `worker_ext` runs inside the server (its weight reload). Light to import:
nothing here imports vLLM into the trainer's process."""
