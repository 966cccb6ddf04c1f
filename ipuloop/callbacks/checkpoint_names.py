"""A checkpoint's folder name: ``ModelCheckpoint``'s filename template, checked before any
save (a plain name, a counter or a log in each field, a growing counter so that no two saves
share a name), its fields, and the template less the fields a save cannot fill.
"""

from __future__ import annotations

import os
import re
import string

from ..state import COUNTERS, GROWING

__all__ = ["check_filename", "fields", "log_name", "without"]


def check_filename(filename: str, monitor: str | None, every_n_steps: int | None) -> None:
    """``ModelCheckpoint``'s filename template, checked before any save."""

    def filename_error(why: str) -> ValueError:
        return ValueError(
            f"ModelCheckpoint: filename={filename!r} {why}. Example: "
            "filename='epoch{epoch}-step{step}-{val_loss:.3f}'."
        )

    if not isinstance(filename, str):
        raise filename_error("must be a str")
    try:
        parts = list(string.Formatter().parse(filename))
    except ValueError as e:
        raise filename_error(f"is not a format template ({e})") from None
    keys = {f for _, f, _, _ in parts if f is not None}
    text = "".join(t for t, _, _, _ in parts)
    if any(sep and sep in text for sep in ("/", os.sep, os.altsep)) or text.startswith("."):
        raise filename_error(
            "must give a plain folder name inside dirpath: no path separator, no leading '.'"
        )
    for key in sorted(keys):
        if not log_name(key):
            raise filename_error(
                f"has the field {{{key}}}: use names only (a counter or a log, a validation "
                "set's as val_<name>/<set>), no positional fields, attributes or indices"
            )
        epoch_log = key.startswith(("train_", "val_"))
        if key not in COUNTERS and key != "loss" and key != monitor and not epoch_log:
            raise filename_error(
                f"names {{{key}}}, which is neither a counter ({', '.join(COUNTERS)}) "
                "nor a log the loop writes (loss, train_<name>, val_<name>) nor the "
                f"monitored log (monitor={monitor!r})"
            )
        if key.startswith("train_") and every_n_steps:
            raise filename_error(
                f"names {{{key}}}, a log written at the end of an epoch, so the step saves "
                f"(every_n_steps={every_n_steps}) before the first epoch end could not "
                "name their folder. Leave it out, or set every_n_steps=None"
            )
    if not keys & set(GROWING):
        raise filename_error(
            "has no {step} (or {update}, {micro_batch}, {samples}): two saves would "
            "get the same name, and the later would overwrite a kept checkpoint"
        )
    try:  # a format spec that a counter (int) or a log (float) rejects
        filename.format(**{k: 0 if k in COUNTERS else 0.0 for k in keys})
    except (ValueError, TypeError) as e:
        raise filename_error(f"cannot be formatted: {e}") from None


def log_name(key: str) -> bool:
    """A filename field that names a counter or a log: an identifier, or a validation set's
    log ``val_<name>/<set>`` (the "/" is in the field only: the folder gets its value)."""
    name, slash, suffix = key.partition("/")
    return name.isidentifier() and (
        not slash
        or (name.startswith("val_") and re.fullmatch(r"[A-Za-z0-9_-]+", suffix) is not None)
    )


def fields(template: str) -> list[str]:
    return [f for _, f, _, _ in string.Formatter().parse(template) if f is not None]


def without(template: str, fields: set[str]) -> str:
    """``template`` less each field of ``fields`` and the text just before it (its
    separator): "epoch{epoch}-step{step}-{val_loss:.3f}" less val_loss is
    "epoch{epoch}-step{step}"."""
    out = []
    for text, field, spec, conversion in string.Formatter().parse(template):
        if field in fields:
            continue
        out.append(text.replace("{", "{{").replace("}", "}}"))
        if field is not None:
            out.append(
                "{"
                + field
                + (f"!{conversion}" if conversion else "")
                + (f":{spec}" if spec else "")
                + "}"
            )
    return "".join(out)
