"""The OpenAI-compatible HTTP server (`specwood serve`): FastAPI + uvicorn over one
continuous-batching Scheduler. `create_app(engine, scheduler)` builds the app; `serve(engine, ...)`
runs it."""
from specwood.serve.app import create_app, make_scheduler, serve

__all__ = ["create_app", "make_scheduler", "serve"]
