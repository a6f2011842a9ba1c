"""OpenAI chat and text completions: request schema, handlers, response shapes."""
