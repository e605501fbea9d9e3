"""The in-process backend: the learner's own model samples (`backend`), through the batched decoder
(`generate` over `decode`) that reads a group's prompt from one shared copy (`prefix`)."""
