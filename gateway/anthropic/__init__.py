"""The Anthropic Messages API family."""
