"""OpenAI's Responses API: the request parser, the route, the response store."""
