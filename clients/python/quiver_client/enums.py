"""Status, Tier, Reason and ExplainSkipped, built from the generated bindings.

The members are the schema's (``schemas/quiver.fbs``), renamed to Python's
constant style: ``DeadlineExceeded`` becomes ``Status.DEADLINE_EXCEEDED``,
``BreakerOpen`` ``Reason.BREAKER_OPEN``. ``member.name.lower()`` is the name
``quiver score --json`` prints. Deriving them from the generated code means
a new enum value in the schema needs only a regeneration.
"""

from __future__ import annotations

import enum
import re
from typing import Any

from ._generated.quiver.wire import ExplainSkipped as _explain_skipped
from ._generated.quiver.wire import Reason as _reason
from ._generated.quiver.wire import Status as _status
from ._generated.quiver.wire import Tier as _tier


def _enum(name: str, generated: type) -> Any:
    members = {
        re.sub(r"(?<!^)(?=[A-Z])", "_", k.rstrip("_")).upper(): v
        for k, v in vars(generated).items()
        if not k.startswith("_")
    }
    return enum.IntEnum(name, members, module=__name__)


#: Response status; an unknown value reads as ``INTERNAL`` (schema rule).
Status = _enum("Status", _status.Status)
#: Which rung of the degradation ladder answered; an unknown value reads as ``DEFAULT``.
Tier = _enum("Tier", _tier.Tier)
#: Why the tier is not ``PRIMARY``; an unknown value reads as ``NONE``
#: (flatc spells that member ``None_``).
Reason = _enum("Reason", _reason.Reason)
#: Why a request that asked for explanations got none; an unknown value
#: reads as ``NONE``.
ExplainSkipped = _enum("ExplainSkipped", _explain_skipped.ExplainSkipped)
