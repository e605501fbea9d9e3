"""What an episode is played against (docs/design.md §6d, §6e): the environment and its tools (`env`), the
worker processes that run them where a timeout can stop them (`process`), how turns become tokens and
tokens tool calls (`turns`); for agent programs, the OpenAI-compatible endpoint they call (`endpoint`),
an episode's requests as branches of its token tree (`transcript`), and running the program itself
(`runner`). The samplers that play episodes are rl/rollout/'s."""
