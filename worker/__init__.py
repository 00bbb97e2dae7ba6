"""The engine side of llmfleet: adapters that generate, and the consumer that feeds them."""
