"""The in-process backend: the learner's own model samples (`backend`), through the batched decoder
(`generate` over `decode`) that reads a group's prompt from one shared copy (`prefix`); an episode's
images (a tool's screenshot) fed at their placeholders as the turns come (`gallery`)."""
