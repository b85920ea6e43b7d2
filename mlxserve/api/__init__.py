"""HTTP only: the FastAPI app, OpenAI and Anthropic schemas, SSE, errors and auth."""
