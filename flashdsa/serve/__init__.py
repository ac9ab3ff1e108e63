"""OpenAI-compatible HTTP server over the engine (FastAPI + uvicorn): ``flashdsa serve``."""
