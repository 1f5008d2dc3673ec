"""Request-side structured output and tool calling: OpenAI/vLLM fields -> engine constraints."""
