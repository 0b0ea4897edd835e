"""``pwrun serve``: the OpenAI-compatible HTTP server (FastAPI + uvicorn) around one engine thread."""
