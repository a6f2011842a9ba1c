"""Anthropic's Messages API: the route and its shapes."""
