"""The dashboard (``llmgw dashboard``): one live, read-only web page of the fleet.

``app.Dashboard`` serves the page, its static files (``static/``) and Server-Sent Events
from one view of the streams, behind the same API keys as the router; ``app.Limits``
bounds what any one client may hold.
"""

from typing import TYPE_CHECKING

from llmgw import lazy_face

if TYPE_CHECKING:
    from llmgw.dashboard.app import Dashboard, Limits

_FACE = {"Dashboard": "llmgw.dashboard.app", "Limits": "llmgw.dashboard.app"}
__all__ = ["Dashboard", "Limits"]
__getattr__ = lazy_face(__name__, _FACE)
