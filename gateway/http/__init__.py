"""The edge around every route: API keys, body limits, error bodies and handlers, accounting and request ids."""
