"""The HTTP endpoints, grouped by what they serve."""

from server.routes.chat import router as chat_router
from server.routes.sessions import router as sessions_router
from server.routes.status import router as status_router
from server.routes.text_completion import router as text_completion_router
from server.routes.tokenize import router as tokenize_router
from server.routes.web import router as web_router

__all__ = ["chat_router", "sessions_router", "status_router", "text_completion_router", "tokenize_router",
           "web_router"]
