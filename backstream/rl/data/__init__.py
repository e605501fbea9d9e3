"""Where prompts come from: `[data]`, files and chat messages rendered and encoded, the prompt stream
(`prompts`), and the built-in generated tasks (`tasks`)."""
