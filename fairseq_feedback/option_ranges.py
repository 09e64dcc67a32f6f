"""The values an option can take, said where the option is declared, in one way: in its field's
metadata for this plugin's options (models/feedback_config.py, tasks/feedback_language_modeling.py),
in dictionaries of the same keys for fairseq's options (fairseq_fixes/option_values.py); and the one
check that reads them; check_types reads a value that bypasses the command line's parser
(--model-overrides) as that parser reads it. (What a machine takes of the tools' options,
fairseq_feedback_cli/machine.py checks in the same words: the data scripts that check it do not load
this plugin.)

    "at_least", "above"   the lowest value, or the value every value is above
    "at_most", "below"    the highest value, or the value every value is below
    "off"                 a value outside the range that turns the option off (fairseq's -1)
"""

from dataclasses import fields

from omegaconf import ListConfig

from .errors import FeedbackUsageError

BOUNDS = ("at_least", "above", "at_most", "below")


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def number(value):
    """An option's number; None if it has none yet (unset, or an interpolation
    of another option's value). fairseq's parser leaves the options it fills
    by interpolation, such as --decoder-output-dim, as strings."""
    if isinstance(value, str):
        try:
            return float(value) if any(c in value for c in ".eE") else int(value)
        except ValueError:
            return None
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def field_ranges(config) -> dict:
    """{option: its field's metadata} of a dataclass's fields that state a range."""
    return {f.name: f.metadata for f in fields(config) if any(bound in f.metadata for bound in BOUNDS)}


def check_ranges(options, ranges: dict) -> None:
    """Each option of `options` (a section of a configuration, a Namespace) that `ranges` names, in its
    range; an option it lacks or leaves unset is skipped, and one of several values (--lr 1e-3,1e-4)
    is checked value by value."""
    for name, bounds in ranges.items():
        given = getattr(options, name, None)
        for value in map(number, given if isinstance(given, (list, tuple, ListConfig)) else [given]):
            if value is not None and not _within(value, bounds):
                raise FeedbackUsageError(f"{flag(name)} must be {_described(bounds)}, got {value}")


def check_types(values: dict, actions: dict) -> None:
    """Each value of `values` (--model-overrides, which fairseq evaluates as Python and hands to the
    model as it is: {'memory_span': 'x'} reached its arithmetic, a TypeError) read as the command line
    reads its option: by its type and choices (`actions`: argparse's, by option); unset (None), or
    of an option without a type (a flag), it is skipped."""
    for name, value in values.items():
        action = actions.get(name)
        if action is None or action.type is None or value is None:
            continue
        try:  # a type of Python's gives the value back; fairseq's list types give '0,1' as [0, 1]
            read = action.type(str(value))
            fits = (read == value or action.type not in (int, float, str)) and value in (action.choices or [value])
        except Exception:  # refused by the type, as argparse refuses it (fairseq's list types evaluate Python)
            fits = False
        if not fits:
            kind = {int: "an integer", float: "a number", str: "text"}.get(action.type, "as the command line gives it")
            if action.choices is not None:
                kind = f"one of {', '.join(map(str, action.choices))}"
            raise FeedbackUsageError(f"{flag(name)} must be {kind}, got {value!r}")


def _within(value, bounds) -> bool:
    return value == bounds.get("off", value + 1) or (
        value >= bounds.get("at_least", value) and value <= bounds.get("at_most", value)
        and ("above" not in bounds or value > bounds["above"]) and ("below" not in bounds or value < bounds["below"]))


def _described(bounds) -> str:
    """at least 1; greater than 0; in [0, 1); ... (or -1: off)."""
    low = next(((bracket, bounds[key]) for key, bracket in (("at_least", "["), ("above", "(")) if key in bounds), None)
    high = next(((bracket, bounds[key]) for key, bracket in (("at_most", "]"), ("below", ")")) if key in bounds), None)
    if low and high:
        text = f"in {low[0]}{low[1]}, {high[1]}{high[0]}"
    elif low:
        text = f"at least {low[1]}" if low[0] == "[" else f"greater than {low[1]}"
    else:
        text = f"at most {high[1]}" if high[0] == "]" else f"less than {high[1]}"
    return text + (f" (or {bounds['off']}: off)" if "off" in bounds else "")
