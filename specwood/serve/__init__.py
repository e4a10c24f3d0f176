"""The OpenAI-compatible HTTP server (`specwood serve`): FastAPI + uvicorn over one
continuous-batching Scheduler. `create_app(engine, scheduler)` builds the app (its handlers:
`OpenAIServing`); `serve(engine, server_config(...))` runs it."""
from specwood.serve.app import create_app, serve, server_config
from specwood.serve.serving import OpenAIServing

__all__ = ["OpenAIServing", "create_app", "serve", "server_config"]
