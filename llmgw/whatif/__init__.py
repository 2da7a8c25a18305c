"""What if (``llmgw ctl what-if``): the recorded history re-decided under another policy.

``window.what_if`` checks the window asked for and streams its events once, in order, to
every policy; ``policies`` re-decides each with the scheduler's own ``decide``
(``Replay``, one ``Sim`` per policy beside the recorded one); ``meter`` measures what
each cost (GPU-hours, cold starts, requests held) alike for all of them.
"""

from typing import TYPE_CHECKING

from llmgw import lazy_face

if TYPE_CHECKING:
    from llmgw.whatif.policies import Policy
    from llmgw.whatif.window import WhatIfReport, what_if

_FACE = {
    "Policy": "llmgw.whatif.policies",
    "WhatIfReport": "llmgw.whatif.window",
    "what_if": "llmgw.whatif.window",
}
__all__ = ["Policy", "WhatIfReport", "what_if"]
__getattr__ = lazy_face(__name__, _FACE)
