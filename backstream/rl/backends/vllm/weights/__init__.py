"""How the learner's weights reach the vLLM servers (docs/vllm.md, "Weights every step"): the one part of
the rollout layer that knows how weights travel. The learner's side (`sync.py`: `DiskSync`,
`TransferSync`, `AdapterSync`, `ColocatedSync`, each `sync(model, step)`, and `build`), the transfer
group it drives (`transfer.py`), the server's side (`engine.py`, inside the vLLM worker: the transfer
engine and the disk reload), and what both compute of a publish to prove it landed (`ledger.py`).
Importing this package imports nothing: the server's worker imports `engine` alone."""

ENGINE = "backstream"  # the name vLLM's weight-transfer factory knows the servers' engine by (engine.py)
