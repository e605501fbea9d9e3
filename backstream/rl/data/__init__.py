"""Where prompts come from: `[data]`, files and chat messages rendered and encoded, the prompt stream
(`prompts`), the images in them read and processed (`images`), and the built-in generated tasks
(`tasks`; the picture-counting task's images are drawn by `shapes`)."""
