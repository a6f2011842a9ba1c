"""What the API folders share: one assistant turn, tools, reasoning, structured output, SSE."""
