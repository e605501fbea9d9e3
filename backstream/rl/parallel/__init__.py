"""Who runs where: data parallelism under torchrun (docs/design.md §6c): the process group and its
collectives (`collectives`), the split of every step's global batch by whole prompt groups
(`placement`), and the one object the run holds (`dataparallel`: `DataParallel`, `Torchrun`, `start`),
so that the trainer's step reads the same in one process and under torchrun.

    torchrun --nproc_per_node 8 -m backstream train run.toml                      one node, 8 GPUs
    torchrun --nnodes 2 --nproc_per_node 8 --rdzv_id JOB \\
             --rdzv_backend c10d --rdzv_endpoint HOST:29500 -m backstream train run.toml   on each node

`start(...)` returns a `DataParallel`: in a plain process the one-process object, whose every method
is the identity (this process samples and trains the whole batch, gathers return [x]); under
torchrun a `Torchrun`, which gives the update one process would give on the same global batch:
- every rank walks the same seeded prompt stream; a step's `train.prompts_per_step` prompts are the
  GLOBAL batch, and each rank trains whole prompt groups (a token tree never spans ranks): of every
  minibatch, rank r takes the r-th of W equal contiguous slices (`rank_groups`); with the rollout's
  K/V reused, the groups it sampled (K/V never travel; DAPO refills go to the ranks that keep the
  fewest, `round_share`'s `held`, so the shares end even);
- a group's completions are drawn with a generator seeded from (train.seed, the prompt's position in
  the stream) (`group_generator`), so they do not depend on which rank draws them; the rollouts are
  then gathered, so every rank holds the global batch (rewards, advantages, metrics as one process
  has them) and keeps the samples of its own groups for the update;
- the loss normalisers (Σ|y_i|, N, L_max) are those of the global minibatch (`losses.Normalisers`),
  and FSDP's gradient reduction is a SUM over ranks (`fsdp.shard`): Σ_ranks ∇(global-normalised
  local loss) = ∇(the single-process loss);
- the gradient norm of `clip_grad_norm` is the global one (`fsdp.grad_norm`), so clipping and the
  non-finite guard agree on every rank.
Parameters are gathered once around each phase that runs forwards only (`fsdp.gathered`) and once
per engine call (`fsdp.FSDPCall`), so FSDP's per-layer resharding never applies (no
`reshard_after_forward` key).

Rank 0 alone writes the run folder (lock, config.toml, metrics.jsonl, progress); checkpoints are
written by every rank together (checkpoint.save: DCP shards + a Hugging Face export) and a run resumes
on any number of ranks. A rank that raises leaves the process group at once, and a rank killed
outright closes its connections, so the others stop with an error that says so (gloo: at once;
nccl: within `timeout_s`) instead of hanging; torchrun then ends the job.

Quantized layers (quant/linear.py) hold the Linear's own Parameters, so FSDP shards them with their
layer and the codes are computed from the gathered weights. The frozen KL reference policy of a full
fine-tune is sharded the same way (1/N of a copy per rank, gathered once per log-prob pass); with
LoRA it is the base model under the adapters. The MoE router load-balancing loss takes its routing
counts and N from the whole minibatch: one all-reduce inside the engine call (stream/router.py).
"""
