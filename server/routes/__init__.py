"""The HTTP endpoints, grouped by what they serve."""

from server.routes.chat import router as chat_router
from server.routes.status import router as status_router

__all__ = ["chat_router", "status_router"]
