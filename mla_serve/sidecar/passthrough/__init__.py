"""The OpenAI pass-through: requests to vLLM and its answers back, classified."""
