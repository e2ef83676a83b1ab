"""Serving layers over the engine: the OpenAI-compatible server (`deepserve.serving.openai`)."""
