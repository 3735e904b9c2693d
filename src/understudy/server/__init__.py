"""The OpenAI-compatible server and the Lab (`understudy serve`); needs fastapi and uvicorn."""

from understudy.server.app import create_app

__all__ = ["create_app"]
