"""Rollouts on a pool of vLLM servers (docs/design.md §1, the QaRL paper's hybrid): the servers sample, the
learner publishes its weights to them after every optimizer step. `backend` is the backend behind the
protocols (rl/backends/base.py) and `build`; `pool` routes requests to the servers and brings back the
dead; `requests` makes the generate calls; `server` starts one server and talks to it ([vllm]);
`context` checks what a server must hold before the run folder is written; `alignment` is QaRL's check
of a low-bit server; `serve` and `launch` are `backstream vllm serve` (a server of your own, its API key
over every route); `setup` builds vLLM's own virtual environment; `worker_ext` runs inside the server;
`weights/` is how the learner's weights reach the servers. Light to import: nothing here imports vLLM
into the trainer's process."""
