"""How the learner's weights reach the vLLM servers (docs/vllm.md, "Weights every step"): the one part of
the rollout layer that knows how weights travel. The learner's side (`sync`: `DiskSync`, `TransferSync`,
`AdapterSync`, `ColocatedSync`, each `sync(model, step)`), the transfer group it drives (`transfer`), the
server's side (`receive`, inside the vLLM worker: the transfer engine and the disk reload), and what both
compute of a publish to prove it landed (`ledger`), and the served checkpoint's names of the policy's
tensors on a server of another class (`names`). Importing this package imports nothing: the
server's worker imports `receive` alone."""

ENGINE = "backstream"  # the name vLLM's weight-transfer factory knows the servers' engine by (engine.py)
