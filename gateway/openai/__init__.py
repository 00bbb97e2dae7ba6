"""OpenAI API families: chat completions, completions, responses."""
