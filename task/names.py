"""Names that become part of a file or folder name: checked before they touch a path.

A hospital builds file names from strings other parties choose: the run tag a DP-FedAvg server sends names
the hospital's per-run ledger, a simulated world's split names each hospital's folder and ledger file. Such a
string must not be able to name another file: ``x/../privacy-ledger`` would make a run's ledger the
hospital's lifetime ledger, and ``../../elsewhere`` would write outside the hospital's folder. So it is
refused unless it is one plain file-name part: 1 to :data:`MAX_LENGTH` characters from ``A-Z a-z 0-9 . _ +
-``, starting with a letter or digit, never ``..`` -- no separator, no parent, no hidden file, nothing a
shell or a file system reads specially.
"""

from __future__ import annotations

import re
from typing import Any

from task.errors import UserError

#: the longest accepted name part (file names allow 255 bytes; a prefix and a suffix are added)
MAX_LENGTH = 64

_SAFE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]*")


def check_name_part(value: Any, what: str, max_length: int = MAX_LENGTH) -> str:
    """``value`` as a string when it is a safe file-name part (see the module docstring); else UserError
    naming ``what`` (who sent it and what it is, e.g. ``"the server's run_tag"``)."""
    text = value if isinstance(value, str) else None
    if text is None or not (0 < len(text) <= max_length) or not _SAFE.fullmatch(text) or ".." in text:
        shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
        raise UserError(f"{what}={shown}: expected 1-{max_length} characters from letters, digits, '.', '_', "
                        "'+' and '-', starting with a letter or digit, without '..' (it names a file)")
    return text


def safe_name_part(text: str, max_length: int = 32, fallback: str = "run") -> str:
    """A safe name part made from any text (a folder's name, say): unsafe runs become ``-``, dots never
    repeat, the result is cut to ``max_length`` and starts with a letter or digit (``fallback`` when nothing
    is left). What a sender uses so that :func:`check_name_part` accepts what it sends."""
    part = re.sub(r"\.{2,}", ".", re.sub(r"[^A-Za-z0-9._+-]+", "-", str(text)))
    part = part.lstrip("._+-")[:max_length].rstrip("._+-")
    return part or fallback
