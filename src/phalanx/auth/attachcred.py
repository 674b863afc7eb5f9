"""The credential `sattach` presents to a step's srun: derived from the step's cookie.

A step's I/O flows through its srun (slurm/srun/command.py, StepIO): the tasks' shepherds
connect to it with the step's random cookie, which srun chose and the controller stores with
the step.  A second client of the step's I/O (`sattach`) gets from the controller, after the
controller has checked that the caller may attach (controller/steps_api.py), not the cookie
but this token: HMAC-SHA256 keyed by the cookie over a fixed label.  srun computes the same
from its cookie.  So the token lets its holder attach (read the streams, send stdin, as the
step's owner may) but not pose as a task (inject output or an exit record), and nobody who
has not asked the controller can compute it.  Pure: no I/O, standard library only (srun
imports it on the path of a step's connections).
"""

from __future__ import annotations

import hashlib
import hmac

LABEL = b"phalanx sattach v1"


def attach_token(cookie: str) -> str:
    """The token that attaches to the step whose cookie is `cookie` (64 hex digits)."""
    return hmac.new(cookie.encode(), LABEL, hashlib.sha256).hexdigest()
