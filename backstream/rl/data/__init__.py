"""Where prompts come from: data files and the built-in generated tasks, rendered and encoded."""
