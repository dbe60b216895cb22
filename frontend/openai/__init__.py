"""OpenAI's API families: chat completions, completions, the Responses API, and vLLM's extensions to them."""
