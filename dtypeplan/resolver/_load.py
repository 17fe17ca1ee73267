"""``load_config``: a DeepSpeed-style config (a file or a dict) -> :class:`PrecisionConfig`.

A straight pipeline; each stage is one function, document in and document out (plus what it
notes), owned by one module. Stages 4 and 6 are both DeepSpeed's spellings, split around the
schema so that a schema error names the key the user wrote.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from dtypeplan.resolver._auto import fill_auto
from dtypeplan.resolver._config import PrecisionConfig
from dtypeplan.resolver._deepspeed import canonical_spellings, screen
from dtypeplan.resolver._fields import read_fields
from dtypeplan.resolver._input import read_config
from dtypeplan.resolver._schema import top_level_keys, validate

__all__ = ["load_config"]


def load_config(
    config: dict[str, Any] | str | os.PathLike[str],
    *,
    auto: Mapping[str, Any] | None = None,
    strict: bool = False,
) -> PrecisionConfig:
    """Validate ``config`` (a dict, or a path to a .json / .yaml file) and return its settings.

    ``auto`` fills the config's ``"auto"`` values (see ``_auto.py``); ``strict`` makes an
    unknown top-level key an error instead of a warning. Raises :class:`PrecisionConfigError`
    naming the JSON path of the first bad value. The stages, in order:

    1) read (``_input.read_config``): a path is read and parsed, a dict taken as it is.
    2) bounds (``_input``, during the parse; ``check_document`` for a dict): bytes, depth,
       values, integer digits, unique keys; the document must be a mapping.
    3) auto (``_auto.fill_auto``): every ``"auto"`` filled from ``auto`` or the HF Trainer's
       defaults, or dropped; each recorded.
    4) screen (``_deepspeed.screen``): blocks DeepSpeed removed are refused, unknown top-level
       keys set aside with a warning (an error under ``strict``).
    5) schema (``_schema.validate``): the JSON Schema, at the path the user wrote; the keys
       that change nothing and the model-side ones are marked.
    6) spellings (``_deepspeed.canonical_spellings``): DeepSpeed's aliases folded into one name.
    7) typed fields (``_fields.read_fields``): one reader per block, the ``optimizer`` and
       ``scheduler`` blocks in ``_optimizer_block``.
    """
    document, source = read_config(config)
    document, auto_values = fill_auto(document, auto)
    document, unknown = screen(document, top_level_keys(), strict=strict)
    marks = validate(document)
    document, renamed = canonical_spellings(document)
    return read_fields(
        document,
        source=source,
        auto_values=auto_values,
        notes=(*unknown, *marks.warnings, *renamed),
        ignored=marks.ignored,
    )
