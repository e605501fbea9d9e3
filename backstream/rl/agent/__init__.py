"""Agentic episodes (docs/design.md §6d): the environment and its tools (`env`), the worker processes
that run them where a timeout can stop them (`worker`), how turns become tokens (`turns`), and the
sampler that plays episodes (`episodes`)."""
